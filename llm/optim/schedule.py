"""Learning-rate schedules as pure multiplier functions of the step, wrapped in a LambdaLR.

Every schedule shares one warmup, nanoGPT's: optimizer step ``s < warmup_steps`` runs at
``(s + 1) / (warmup_steps + 1)`` of the peak, so step 0 already learns a little (a step at
lr 0 is wasted) and step ``warmup_steps`` reaches 1. After warmup each schedule maps its
progress to a multiplier; past ``max_steps`` it holds its final value.

A warmup that does not fit the run (``warmup_steps >= max_steps``, as the default 30 steps
in a 6-step smoke run) is clamped to a tenth of the run, ``max_steps // 10`` (none under 10
steps), rather than refused: :func:`clamped_warmup` says so, and the Trainer logs it.

LambdaLR calls the multiplier with the number of ``scheduler.step()`` calls so far, so the
k-th optimizer step (0-based) uses ``multiplier(k)`` when the loop steps the scheduler after
the optimizer. Its state_dict (the step count) is what checkpoints carry; the functions are
``functools.partial`` objects with no ``__dict__`` state, so a resumed run takes its shape
from the config it was started with, not from the checkpoint.
"""

from __future__ import annotations

import dataclasses
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


def clamped_warmup(warmup_steps: int, max_steps: int) -> int:
    """The warmup a run of ``max_steps`` uses: ``warmup_steps`` when it leaves steps after
    it, else a tenth of the run (``max_steps // 10``)."""
    return warmup_steps if warmup_steps < max_steps else max_steps // 10


def warmup_note(cfg: SchedulerConfig, max_steps: int) -> str | None:
    """One line for the log when the configured warmup was clamped to the run, else None."""
    warmup = clamped_warmup(cfg.warmup_steps, max_steps)
    if warmup == cfg.warmup_steps:
        return None
    return (
        f"scheduler.warmup_steps={cfg.warmup_steps} does not fit train.max_steps={max_steps}: "
        f"warming up for {warmup} steps (a tenth of the run) instead"
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that scales every param group's lr by :func:`lr_multiplier`, with the
    warmup clamped to the run (:func:`clamped_warmup`)."""
    if cfg.name not in SCHEDULES:
        raise ConfigError(
            f"scheduler.name={cfg.name!r} is unknown; choose one of {', '.join(SCHEDULES)}"
        )
    cfg = dataclasses.replace(cfg, warmup_steps=clamped_warmup(cfg.warmup_steps, max_steps))
    fn = functools.partial(lr_multiplier, cfg=cfg, max_steps=max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
