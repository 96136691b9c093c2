"""Probe steps run the instruments, timed steps run none (llm/train/probes.py): the schedule,
and a real run whose every instrument is counted per step."""

from __future__ import annotations

import collections

import pytest

import llm.memory.activations as activations
import llm.train.fp8_watch as fp8_watch
from llm.config import TrainConfig
from llm.errors import ConfigError
from llm.memory.live import LiveStorages, OpOutputs
from llm.parallel.strategy import StrategyBase
from llm.train.probes import ProbeSchedule
from llm.train.trainer import Trainer
from tests.helpers import read_metrics, run


def probes(schedule: ProbeSchedule, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if schedule.probes(s)]


def test_logged_probes_step_one_and_the_logged_steps():
    assert probes(ProbeSchedule("logged", 10, 35), 35) == [1, 10, 20, 30, 35]


def test_a_step_after_a_probe_is_timed_so_log_every_one_alternates():
    assert probes(ProbeSchedule("logged", 1, 8), 8) == [1, 3, 5, 7]
    assert probes(ProbeSchedule("off", 1, 8), 8) == [1, 3, 5, 7]


def test_alternate_probes_every_other_step_whatever_is_logged():
    assert probes(ProbeSchedule("alternate", 10, 9), 9) == [1, 3, 5, 7, 9]


def test_every_fp8_recorded_step_probes_even_right_after_a_probe():
    schedule = ProbeSchedule("logged", 10, 20, fp8_every=3)
    assert probes(schedule, 20) == [1, 3, 6, 9, 12, 15, 18, 20]
    assert probes(ProbeSchedule("logged", 10, 4, fp8_every=1), 4) == [1, 2, 3, 4]


def test_the_schedule_depends_on_the_step_alone():
    """A resumed run asks from its first step on; it probes where an unbroken run did."""
    unbroken = probes(ProbeSchedule("logged", 1, 40), 40)
    resumed = ProbeSchedule("logged", 1, 40)
    assert resumed.probes(27) == (27 in unbroken)
    assert probes(resumed, 40) == unbroken


def test_every_step_is_refused_with_its_new_name():
    with pytest.raises(ConfigError, match="memory_tracking=alternate"):
        TrainConfig(memory_tracking="every_step")


@pytest.fixture
def instrument_calls(monkeypatch):
    """Calls of every instrument, by the training step running when they fired."""
    calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    current = {"step": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            if current["step"]:
                calls[current["step"]][name] += 1
            return fn(*args, **kwargs)

        return wrapper

    train_step = Trainer.train_step

    def step_of(self, timer, stop):
        current["step"] = self.state.step + 1
        self.strategy.memory = counted(
            "state_walk", type(self.strategy).memory.__get__(self.strategy)
        )
        try:
            return train_step(self, timer, stop)
        finally:
            current["step"] = 0

    count_comm = StrategyBase.count_comm

    def comm_counting(self, on):
        # Called by train_step before the step: the step it decides for is already current.
        if on:
            calls[current["step"]]["comm_counting"] += 1
        return count_comm(self, on)

    monkeypatch.setattr(Trainer, "train_step", step_of)
    monkeypatch.setattr(StrategyBase, "count_comm", comm_counting)
    monkeypatch.setattr(
        OpOutputs, "__torch_dispatch__", counted("dispatch", OpOutputs.__torch_dispatch__)
    )
    monkeypatch.setattr(
        LiveStorages, "wrap_resize", counted("resize_patch", LiveStorages.wrap_resize)
    )
    monkeypatch.setattr(activations, "_pack", counted("saved_tensor_hook", activations._pack))
    monkeypatch.setattr(
        fp8_watch, "record_fp8_stats", counted("fp8_stats", fp8_watch.record_fp8_stats)
    )
    return calls


@pytest.mark.parametrize(
    ("extra", "schedule"),
    [
        (("train.log_every=1",), ProbeSchedule("logged", 1, 8)),
        (
            ("train.memory_tracking=alternate", "train.log_every=3"),
            ProbeSchedule("alternate", 3, 8),
        ),
        (("train.log_every=3", "recompute=none"), ProbeSchedule("logged", 3, 8)),
        (
            ("precision=fp8_tensorwise", "precision.fp8_stats_every=4", "train.log_every=2"),
            ProbeSchedule("logged", 2, 8, fp8_every=4),
        ),
        (("parallelism.count_comm=true", "train.log_every=1"), ProbeSchedule("logged", 1, 8)),
    ],
    ids=["logged-every-step", "alternate", "logged-every-3rd", "fp8-stats", "count-comm"],
)
def test_a_timed_step_runs_no_instrument(
    tmp_path, text_corpus, cache_dir, instrument_calls, extra, schedule
):
    summary, out = run(tmp_path, "run", text_corpus, cache_dir, "train.max_steps=8", *extra)
    expected = set(probes(schedule, 8))
    # The instruments fired on the schedule's probes and on no other step.
    assert {s for s, c in instrument_calls.items() if sum(c.values())} == expected
    for s in expected:
        c = instrument_calls[s]
        assert c["dispatch"] > 0 and c["resize_patch"] == 1  # the peak tracker
        assert c["saved_tensor_hook"] > 0 and c["state_walk"] == 1
        assert c["fp8_stats"] == schedule.records_fp8(s)
        assert c["comm_counting"] == ("parallelism.count_comm=true" in extra)
    assert summary["timed_steps"] == 8 - len(expected) and summary["probe_steps"] == len(expected)
    # Each line says whether it probed; its timings come from timed steps only, and a probe
    # line's memory figures from that step.
    rows = {m["step"]: m for m in read_metrics(out) if "loss" in m}
    assert {s for s, m in rows.items() if m["probe"]} == expected & set(rows)
    for m in rows.values():
        assert (m["step_time_s"] is None) == (m["timed_steps"] == 0)
        assert ("activation_bytes" in m) == ("memory_peak" in m) == m["probe"]
    assert sum(m["timed_steps"] for m in rows.values()) == 8 - len(expected)


def test_tracking_counts_as_an_instrument_and_off_leaves_the_tracker_out(
    tmp_path, text_corpus, cache_dir, instrument_calls
):
    run(tmp_path, "off", text_corpus, cache_dir, "train.max_steps=4", "train.memory_tracking=off")
    assert all(c["dispatch"] == c["resize_patch"] == 0 for c in instrument_calls.values())
    assert instrument_calls[1]["saved_tensor_hook"] > 0  # the activation counter still probes
