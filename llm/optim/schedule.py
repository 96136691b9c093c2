"""Learning-rate schedules as pure multiplier functions of the step, wrapped in a LambdaLR.

Every schedule shares one warmup, nanoGPT's: optimizer step ``s < warmup_steps`` runs at
``(s + 1) / (warmup_steps + 1)`` of the peak, so step 0 already learns a little (a step at
lr 0 is wasted) and step ``warmup_steps`` reaches 1. After warmup each schedule maps its
progress to a multiplier; past ``max_steps`` it holds its final value.

LambdaLR calls the multiplier with the number of ``scheduler.step()`` calls so far, so the
k-th optimizer step (0-based) uses ``multiplier(k)`` when the loop steps the scheduler after
the optimizer. Its state_dict (the step count) is what checkpoints carry; the functions are
``functools.partial`` objects with no ``__dict__`` state, so a resumed run takes its shape
from the config it was started with, not from the checkpoint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from llm.config import SchedulerConfig
from llm.errors import ConfigError

# decay(step, cfg, max_steps) -> multiplier, called only for step >= cfg.warmup_steps.
Decay = Callable[[int, SchedulerConfig, int], float]


def _progress(step: int, start: float, end: float) -> float:
    """Where ``step`` lies in [start, end], clamped to [0, 1]."""
    if end <= start:
        return 1.0
    return min(max((step - start) / (end - start), 0.0), 1.0)


def _cosine(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    t = _progress(step, cfg.warmup_steps, max_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def _linear(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    t = _progress(step, cfg.warmup_steps, max_steps)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * t


def _constant(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    return 1.0


def _wsd(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    """Warmup-stable-decay: 1 until the last ``decay_ratio * max_steps`` steps, then linear.

    When the decay window would reach back into warmup, decay starts right after warmup
    instead (no stable phase), so the curve never jumps down.
    """
    decay_start = max(max_steps - cfg.decay_ratio * max_steps, cfg.warmup_steps)
    t = _progress(step, decay_start, max_steps)
    return 1.0 - (1.0 - cfg.min_lr_ratio) * t


SCHEDULES: dict[str, Decay] = {
    "cosine": _cosine,
    "linear": _linear,
    "constant": _constant,
    "wsd": _wsd,
}


def lr_multiplier(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    """The fraction of ``optimizer.lr`` used at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    return SCHEDULES[cfg.name](step, cfg, max_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that scales every param group's lr by :func:`lr_multiplier`."""
    if cfg.name not in SCHEDULES:
        raise ConfigError(
            f"scheduler.name={cfg.name!r} is unknown; choose one of {', '.join(SCHEDULES)}"
        )
    if cfg.warmup_steps >= max_steps:
        raise ConfigError(
            f"scheduler.warmup_steps={cfg.warmup_steps} must be < train.max_steps={max_steps}; "
            "lower scheduler.warmup_steps or raise train.max_steps"
        )
    fn = functools.partial(lr_multiplier, cfg=cfg, max_steps=max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
