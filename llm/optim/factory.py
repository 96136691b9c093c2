"""Build an optimizer from config: a name registry plus the decay / no-decay parameter split.

New optimizers (LAMB, Lion, Sophia, Adafactor) register a builder with
``@register_optimizer("name")``; every builder receives the same two param groups, so the
weight-decay rule lives here once and not in each optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llm.config import OptimizerConfig
from llm.errors import ConfigError

OptimizerBuilder = Callable[[list[dict[str, Any]], OptimizerConfig], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerBuilder] = {}

# Device types whose params torch 2.13's fused AdamW/SGD kernels accept; elsewhere (meta,
# anything exotic) `optimizer.fused` is ignored so one config runs on every machine.
_FUSED_DEVICE_TYPES = ("cuda", "cpu")


def register_optimizer(name: str) -> Callable[[OptimizerBuilder], OptimizerBuilder]:
    """Decorator: make ``builder(param_groups, cfg)`` available as ``optimizer=name``."""

    def decorator(builder: OptimizerBuilder) -> OptimizerBuilder:
        OPTIMIZERS[name] = builder
        return builder

    return decorator


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable params into a decayed group (>= 2-D) and an undecayed one (< 2-D).

    As in nanoGPT: matmul weights and embeddings decay; biases and norm gains do not, since
    shrinking them towards zero only fights the normalisation. ``parameters()`` yields a
    tied weight once, so it lands in one group once. Empty groups are dropped.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` over ``model``'s trainable params, split by :func:`param_groups`."""
    return optimizer_for_groups(param_groups(model, cfg.weight_decay), cfg)


def optimizer_for_groups(
    groups: list[dict[str, Any]], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` over ready-made param groups (ZeRO passes shard pieces)."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name={cfg.name!r} is unknown; choose one of {', '.join(sorted(OPTIMIZERS))}"
        )
    if not groups:
        raise ConfigError(
            "the model has no parameters with requires_grad=True; nothing to optimize"
        )
    return OPTIMIZERS[cfg.name](groups, cfg)


def _fused_kwargs(groups: list[dict[str, Any]], fused: bool | None) -> dict[str, bool]:
    """``{"fused": fused}`` when the params live where the fused kernel runs, else ``{}`` (torch default)."""
    devices = {p.device.type for g in groups for p in g["params"]}
    if fused is None or not devices <= set(_FUSED_DEVICE_TYPES):
        return {}
    return {"fused": fused}


@register_optimizer("adamw")
def _adamw(groups: list[dict[str, Any]], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **_fused_kwargs(groups, cfg.fused)
    )


@register_optimizer("sgd")
def _sgd(groups: list[dict[str, Any]], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=False,
        **_fused_kwargs(groups, cfg.fused),
    )
