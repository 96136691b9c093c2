"""Monitor: spike and grad-norm alerts, the alert cap, and the NaN stop."""

import math

import pytest
import torch

from llm.config import MonitorConfig
from llm.errors import TrainingError
from llm.train.monitor import Monitor


def test_quiet_run_has_no_alerts():
    monitor = Monitor(MonitorConfig())
    for step in range(50):
        assert monitor.check(step, {"loss": 4.0 - 0.01 * step, "grad_norm": 1.0}) == []


def test_loss_spike_over_running_mean_alerts():
    monitor = Monitor(MonitorConfig(loss_spike_factor=3.0))
    for step in range(10):
        monitor.check(step, {"loss": 2.0})
    assert monitor.check(10, {"loss": 5.9}) == []
    # The mean is an EMA: 5.9 moved it to 0.9 * 2 + 0.1 * 5.9 = 2.39, so 7.5 > 7.17 spikes.
    (alert,) = monitor.check(11, {"loss": torch.tensor(7.5)})
    assert alert == "loss spike at step 11: 7.5 > 3 x running mean 2.39"


def test_first_step_and_missing_keys_are_not_alerts():
    monitor = Monitor(MonitorConfig())
    assert monitor.check(0, {"loss": 1e6}) == []
    assert monitor.check(1, {"lr": 1e-3}) == []


def test_grad_norm_over_threshold_alerts():
    monitor = Monitor(MonitorConfig(grad_norm_alert=10.0))
    assert monitor.check(0, {"grad_norm": 9.0}) == []
    assert monitor.check(1, {"grad_norm": 12.5}) == [
        "grad norm 12.5 at step 1 exceeds monitor.grad_norm_alert=10"
    ]


def test_alerts_stop_after_max_alerts():
    monitor = Monitor(MonitorConfig(grad_norm_alert=1.0, max_alerts=3))
    alerts = [a for step in range(10) for a in monitor.check(step, {"grad_norm": 5.0})]
    assert len(alerts) == 3
    assert "monitor.max_alerts=3 reached" in alerts[-1]


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_values_stop_training(key, value):
    monitor = Monitor(MonitorConfig())
    with pytest.raises(TrainingError) as err:
        monitor.check(7, {"loss": 2.0, "grad_norm": 1.0, key: value})
    assert str(err.value) == (
        f"{key} is {value} at step 7: lower optimizer.lr, keep train.grad_clip > 0, "
        "or resume from the last checkpoint (checkpoint.resume=auto)"
    )


def test_nan_loss_message_reads_as_documented():
    with pytest.raises(TrainingError, match=r"^loss is nan at step 3: lower optimizer\.lr"):
        Monitor(MonitorConfig()).check(3, {"loss": torch.tensor(float("nan"))})


def test_nan_is_an_alert_when_stop_on_nan_is_off():
    monitor = Monitor(MonitorConfig(stop_on_nan=False))
    monitor.check(0, {"loss": 2.0})
    (alert,) = monitor.check(1, {"loss": math.nan})
    assert alert.startswith("loss is nan at step 1")
    assert monitor.check(2, {"loss": 2.1}) == []  # the NaN did not poison the running mean


def test_skipped_step_inf_grad_norm_is_expected():
    monitor = Monitor(MonitorConfig())
    assert monitor.check(0, {"loss": 2.0, "grad_norm": math.inf, "skipped": True}) == []


def test_monitor_none_checks_nothing():
    monitor = Monitor(MonitorConfig(name="none"))
    assert monitor.check(0, {"loss": math.nan, "grad_norm": 1e9}) == []
