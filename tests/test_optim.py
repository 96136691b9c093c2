"""The optimizer factory (param groups, registry) and the learning-rate schedules."""

import io
import itertools
import math

import pytest
import torch
from torch import nn

from llm.config import OptimizerConfig, SchedulerConfig
from llm.errors import ConfigError
from llm.optim import (
    OPTIMIZERS,
    build_optimizer,
    build_scheduler,
    clamped_warmup,
    lr_multiplier,
    warmup_note,
)


class TinyLM(nn.Module):
    """Embedding -> blocks (Linear + LayerNorm) -> head tied to the embedding."""

    def __init__(self, vocab: int = 16, d: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(n_layers)
        )
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.layers:
            x = x + block(x)
        return self.head(x)


def _names(model: nn.Module, params: list[torch.Tensor]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_weight_decay_only_on_matrices():
    model = TinyLM()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert _names(model, decay["params"]) == {
        "emb.weight",
        "layers.0.1.weight",
        "layers.1.1.weight",
    }
    assert _names(model, no_decay["params"]) == {
        f"layers.{i}.{j}.{k}" for i in range(2) for j in range(2) for k in ("weight", "bias")
    } - {"layers.0.1.weight", "layers.1.1.weight"}


def test_tied_weight_counted_once_and_frozen_params_left_out():
    model = TinyLM()
    model.layers[0][1].bias.requires_grad_(False)
    opt = build_optimizer(model, OptimizerConfig())
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params})
    assert sum(p is model.emb.weight for p in params) == 1
    assert all(p is not model.layers[0][1].bias for p in params)
    assert len(params) == sum(1 for p in model.parameters() if p.requires_grad)


def test_optimizer_kinds_and_hyperparameters():
    model = TinyLM()
    adamw = build_optimizer(
        model, OptimizerConfig(name="adamw", lr=1e-3, betas=[0.8, 0.9], eps=1e-6)
    )
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["betas"] == (0.8, 0.9) and adamw.defaults["eps"] == 1e-6
    sgd = build_optimizer(model, OptimizerConfig(name="sgd", lr=0.1, momentum=0.5))
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.defaults["momentum"] == 0.5 and sgd.defaults["nesterov"] is False


def test_adamw_is_fused_by_default_where_torch_has_the_kernel():
    """fused=None: fused on CPU (and CUDA); false is honoured; params where the kernel
    cannot run (meta) get torch's own choice. sgd keeps torch's default."""
    model = TinyLM()
    assert build_optimizer(model, OptimizerConfig(fused=None)).defaults["fused"] is True
    assert build_optimizer(model, OptimizerConfig(fused=True)).defaults["fused"] is True
    assert build_optimizer(model, OptimizerConfig(fused=False)).defaults["fused"] is False
    assert not build_optimizer(TinyLM().to("meta"), OptimizerConfig()).defaults["fused"]
    assert not build_optimizer(model, OptimizerConfig(name="sgd")).defaults["fused"]


def test_unknown_optimizer_lists_registered_names():
    with pytest.raises(ConfigError, match=r"optimizer\.name='nope'.*adafactor, adamw, adamw8bit"):
        build_optimizer(TinyLM(), OptimizerConfig(name="nope"))
    assert {"adamw", "sgd", "adafactor", "lamb", "lion", "sophia", "muon", "adamw8bit"} == set(
        OPTIMIZERS
    )


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_few_steps_reduce_a_toy_loss(name):
    torch.manual_seed(0)
    model = TinyLM()
    idx = torch.randint(0, 16, (4, 6))
    opt = build_optimizer(model, OptimizerConfig(name=name, lr=1e-2 if name == "adamw" else 0.1))

    def loss_fn() -> torch.Tensor:
        logits = model(idx)
        return nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())

    first = loss_fn().item()
    for _ in range(20):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert loss_fn().item() < 0.8 * first


def _sched(name: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(name=name, warmup_steps=kw.pop("warmup_steps", 10), **kw)


MAX = 110  # 10 warmup steps + 100 decay steps


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_warmup_ramps_from_near_zero_to_one(name):
    cfg = _sched(name)
    assert lr_multiplier(0, cfg, MAX) == pytest.approx(1 / 11)
    assert lr_multiplier(9, cfg, MAX) == pytest.approx(10 / 11)
    assert lr_multiplier(10, cfg, MAX) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("name", "mid", "end"),
    [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1), ("constant", 1.0, 1.0), ("wsd", 1.0, 0.1)],
)
def test_schedule_midpoint_and_end(name, mid, end):
    cfg = _sched(name, min_lr_ratio=0.1, decay_ratio=0.2)
    assert lr_multiplier(60, cfg, MAX) == pytest.approx(mid)
    assert lr_multiplier(MAX, cfg, MAX) == pytest.approx(end)
    assert lr_multiplier(MAX + 50, cfg, MAX) == pytest.approx(end)


def test_wsd_is_flat_until_the_decay_window():
    cfg = _sched("wsd", min_lr_ratio=0.0, decay_ratio=0.2)  # decay over steps 88..110
    assert lr_multiplier(88, cfg, MAX) == pytest.approx(1.0)
    assert lr_multiplier(99, cfg, MAX) == pytest.approx(0.5)
    # A decay window reaching back into warmup starts after warmup: no downward jump.
    wide = _sched("wsd", min_lr_ratio=0.0, decay_ratio=1.0)
    assert lr_multiplier(10, wide, MAX) == pytest.approx(1.0)
    assert lr_multiplier(60, wide, MAX) == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_schedules_rise_then_never_rise(name):
    cfg = _sched(name, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg, MAX) for s in range(MAX + 5)]
    warm, rest = values[:11], values[10:]
    assert all(a < b for a, b in itertools.pairwise(warm))
    assert all(a >= b for a, b in itertools.pairwise(rest))
    assert all(0.0 < v <= 1.0 for v in values)


def test_cosine_curve_formula():
    cfg = _sched("cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(25, cfg, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.parametrize(("warmup", "max_steps", "used"), [(100, 100, 10), (30, 6, 0), (5, 6, 5)])
def test_warmup_longer_than_the_run_is_clamped_to_a_tenth(warmup, max_steps, used):
    assert clamped_warmup(warmup, max_steps) == used
    opt = build_optimizer(TinyLM(), OptimizerConfig(lr=1.0))
    sched = build_scheduler(opt, _sched("constant", warmup_steps=warmup), max_steps=max_steps)
    lrs = []
    for _ in range(max_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # The ramp ends at step `used`: full lr from there on.
    assert lrs[used:] == [1.0] * (max_steps - used) and all(lr < 1.0 for lr in lrs[:used])
    note = warmup_note(_sched("cosine", warmup_steps=warmup), max_steps)
    if used == warmup:
        assert note is None
    else:
        assert f"warming up for {used} steps" in note and "\n" not in note


def test_scheduler_drives_lr_and_round_trips_through_state_dict():
    def make():
        opt = build_optimizer(TinyLM(), OptimizerConfig(lr=1.0))
        return opt, build_scheduler(opt, _sched("linear", min_lr_ratio=0.0), max_steps=MAX)

    opt, sched = make()
    assert opt.param_groups[0]["lr"] == pytest.approx(1 / 11)
    for _ in range(30):
        opt.step()
        sched.step()
    expected = lr_multiplier(30, sched.lr_lambdas[0].keywords["cfg"], MAX)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([expected] * 2)

    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    opt2, sched2 = make()
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    opt2.step()
    sched2.step()
    assert sched2.last_epoch == 31
    assert opt2.param_groups[0]["lr"] == pytest.approx(1.0 - 21 / 100)
