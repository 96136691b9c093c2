"""Our dynamic loss scaler against the libraries its presets copy (torch's GradScaler,
DeepSpeed's DynamicLossScaler, Megatron-LM's rules by hand), and the overflow path through
the shared step routine: a skipped step changes nothing, and the scaler survives resume."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import read_metrics, run
from torch import nn

from llm.config import OptimizerConfig, ParallelismConfig, PrecisionConfig
from llm.errors import TrainingError
from llm.parallel.mesh import ParallelDims
from llm.parallel.single import SingleStrategy
from llm.precision import LossScaler, LossScalerSettings, build_loss_scaler, resolve_precision

# Overflow (True) or clean (False) per step: growth after 3 clean steps (4 for DeepSpeed),
# single and back-to-back overflows, an overflow between clean steps (hysteresis refills
# only with consecutive_hysteresis), a run down to the floor and growth back from it.
SEQUENCE = [
    *[False] * 4,
    True,
    False,
    True,
    True,
    *[False] * 7,
    True,
    *[False] * 2,
    *[True] * 8,
    *[False] * 8,
    True,
    False,
    False,
    True,
    False,
]


def scaler_for(**precision) -> LossScaler:
    return build_loss_scaler(PrecisionConfig(name="fp16", **precision), loss_scaling=True)


def test_torch_preset_follows_grad_scaler():
    ours = scaler_for(loss_scaler="torch", growth_interval=3)
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    reference.scale(torch.ones(()))  # creates its scale tensor
    scales = []
    for overflow in SEQUENCE:
        param.grad = torch.full((1,), float("inf") if overflow else 1.0)
        reference.unscale_(optimizer)
        reference.step(optimizer)
        reference.update()
        ours.update(found_inf=overflow)
        scales.append(ours.scale)
        assert ours.scale == reference.get_scale(), f"after {len(scales)} steps: {scales}"
    assert min(scales) < 2.0**16 < max(scales)  # the sequence both backed off and grew


@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_preset_follows_deepspeed(monkeypatch, consecutive):
    from deepspeed.runtime.fp16 import loss_scaler as ds

    # update_scale asks deepspeed.comm for the rank only to decide who logs.
    monkeypatch.setattr(ds, "dist", SimpleNamespace(get_rank=lambda: 0))
    # Started low so that the sequence reaches the floor (min_scale 1).
    ours = scaler_for(initial_scale=8.0, growth_interval=3, consecutive_hysteresis=consecutive)
    reference = ds.DynamicLossScaler(
        init_scale=8.0,
        scale_window=3,
        min_scale=1.0,
        delayed_shift=2,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,  # ours stops the run by its own count (below)
    )
    scales = []
    for overflow in SEQUENCE:
        reference.update_scale(overflow)
        ours.update(found_inf=overflow)
        scales.append(ours.scale)
        assert ours.scale == reference.cur_scale, f"after {len(scales)} steps: {scales}"
    assert 1.0 in scales and max(scales) > 8.0


def test_megatron_preset_hand_derived():
    s = scaler_for(loss_scaler="megatron")
    assert (s.scale, s.settings.growth_interval, s.settings.min_scale) == (2.0**32, 1000, 1.0)

    def steps(overflow: bool, n: int = 1) -> float:
        for _ in range(n):
            s.update(found_inf=overflow)
        return s.scale

    assert steps(True) == 2.0**32  # hysteresis 2: the first overflow is tolerated
    assert steps(True) == 2.0**31
    assert steps(True) == 2.0**30  # hysteresis spent: every further overflow halves
    assert steps(False, 999) == 2.0**30
    assert steps(False) == 2.0**31  # growth after 1000 clean steps refills hysteresis
    assert steps(True) == 2.0**31  # tolerated again, and the window restarts
    assert steps(False, 999) == 2.0**31
    assert steps(False) == 2.0**32
    assert steps(True, 33) == 1.0  # one tolerated, then 32 halvings to the floor
    assert steps(True, 5) == 1.0 and s.gave_up


def test_static_scale_never_changes():
    s = scaler_for(static_loss_scale=1024.0)
    for overflow in SEQUENCE[:10]:
        s.update(found_inf=overflow)
        assert s.scale == 1024.0
    s.update(found_inf=False)
    for _ in range(2):
        s.update(found_inf=True)
    assert not s.gave_up
    s.update(found_inf=True)
    assert s.gave_up  # three in a row: a static scale counts as its own minimum


def test_min_scale_floors_and_gives_up_after_repeated_overflow():
    s = scaler_for(
        loss_scaler="torch", initial_scale=4.0, min_scale=1.0, max_overflows_at_min_scale=2
    )
    for expected in (2.0, 1.0, 1.0):
        s.update(found_inf=True)
        assert s.scale == expected and not s.gave_up  # reaching the floor does not count
    s.update(found_inf=False)  # a clean step at the floor restarts the count
    s.update(found_inf=True)
    assert not s.gave_up
    s.update(found_inf=True)
    assert s.gave_up and s.scale == 1.0


def test_disabled_scaler_scales_nothing():
    s = build_loss_scaler(PrecisionConfig(name="bf16"), loss_scaling=False)
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss
    s.update(found_inf=True)
    assert s.scale == 1.0 and s.skipped_steps == 1


def test_state_dict_round_trip():
    settings = LossScalerSettings.from_config(PrecisionConfig(name="fp16", growth_interval=3))
    first = LossScaler(settings)
    for overflow in [False, True, False, False, True, True, False, False]:
        first.update(found_inf=overflow)
    second = LossScaler(settings)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    # Growth tracker and hysteresis carry over: both grow and back off in step.
    for overflow in [False, False, True, False, True]:
        first.update(found_inf=overflow)
        second.update(found_inf=overflow)
        assert second.scale == first.scale
    assert second.state_dict() == first.state_dict() and first.skipped_steps == 5


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def strategy_with(settings: LossScalerSettings) -> SingleStrategy:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    strategy = SingleStrategy(
        ParallelismConfig(),
        ParallelDims.from_config(1, 1, 1, 1),
        resolve_precision("fp16", cpu),
        cpu,
        LossScaler(settings),
    )
    model = strategy.wrap(TwoLayers())
    strategy.build_optimizer(model, OptimizerConfig(lr=0.1))
    return strategy


def step(strategy: SingleStrategy, poison: dict[str, float] | None = None):
    """One optimizer step; ``poison`` puts a value into one element of named gradients."""
    strategy.zero_grad()
    strategy.backward(strategy.model(torch.ones(3, 4)).square().mean())
    for name, value in (poison or {}).items():
        strategy.model.get_parameter(name).grad.view(-1)[0] = value
    return strategy.clip_and_step(max_norm=1.0)


def snapshot(strategy: SingleStrategy) -> dict[str, torch.Tensor]:
    tensors = {f"param {n}": p for n, p in strategy.model.named_parameters()}
    for i, state in enumerate(strategy.optimizer.state.values()):
        tensors.update({f"state {i} {k}": v for k, v in state.items()})
    return {k: v.detach().clone() for k, v in tensors.items()}


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_overflow_skips_the_step_and_changes_nothing(bad):
    strategy = strategy_with(LossScalerSettings(initial_scale=2.0**10))
    assert not step(strategy).skipped  # AdamW's state exists from here on
    before = snapshot(strategy)
    result = step(strategy, {"fc2.weight": bad})
    assert result.skipped and result.loss_scale == 2.0**10
    after = snapshot(strategy)
    assert after.keys() == before.keys() and any(k.endswith(" step") for k in after)
    for key in before:
        assert torch.equal(after[key], before[key]), key  # bitwise, the step counter too
    assert strategy.scaler.scale == 2.0**9 and strategy.scaler.skipped_steps == 1
    assert not step(strategy).skipped  # and training goes on


def test_repeated_overflow_at_min_scale_names_the_parameters():
    strategy = strategy_with(
        LossScalerSettings(initial_scale=2.0, min_scale=1.0, max_overflows_at_min_scale=3)
    )
    poison = {"fc1.weight": float("nan"), "fc2.bias": float("inf")}
    for _ in range(3):  # 2 -> 1, then two overflows at the floor are tolerated
        assert step(strategy, poison).skipped
    with pytest.raises(TrainingError, match="3 steps in a row at loss scale 1") as err:
        step(strategy, poison)
    message = str(err.value)
    assert "fc1.weight, fc2.bias" in message and "fc2.weight" not in message
    assert "\n" not in message


@pytest.mark.slow
def test_scaler_state_survives_checkpoint_and_resume(tmp_path, text_corpus, cache_dir):
    """An fp16 run stopped at step 4 and resumed from its checkpoint logs the loss scale,
    skips and losses of the same run uninterrupted. growth_interval=1 makes the scale move
    every step, so a scaler restarted from its initial state would differ."""
    fp16 = ["precision=fp16", "precision.growth_interval=1", "train.max_steps=8"]

    def logged(out, key):
        return {m["step"]: m[key] for m in read_metrics(out) if "loss" in m}

    _, straight = run(tmp_path, "straight", text_corpus, cache_dir, *fp16)
    # Stop where the scale the resumed run starts with is not the one a fresh scaler starts
    # with (growth and overflows move it; where depends on the initial weights).
    scales = logged(straight, "loss_scale")
    stop = next(k for k in range(2, 8) if scales[k + 1] != scales[1])
    run(tmp_path, "resumed", text_corpus, cache_dir, *fp16, f"train.stop_at_step={stop}")
    _, resumed = run(tmp_path, "resumed", text_corpus, cache_dir, *fp16)

    for key in ("loss_scale", "skipped", "skipped_steps"):
        assert logged(resumed, key) == logged(straight, key), key
    assert logged(resumed, "loss") == pytest.approx(logged(straight, "loss"), rel=1e-6)
