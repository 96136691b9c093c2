"""Build an optimizer from config: the registry (llm/optim/registry.py) plus the parameter
split every optimizer shares.

Every builder receives the same param groups, so the weight-decay rule lives here once and
not in each optimizer. Each group names its ``kind``: ``matrix`` (>= 2-D: decayed, and LAMB's
trust ratio applies) or ``vector`` (biases and norm gains: no decay, no trust ratio); Muon
also splits off ``hidden``, the matrices inside transformer blocks, which it orthogonalises.
Groups name their kind because under our ZeRO the optimizer sees 1-D pieces of parameters,
whose own shape no longer tells a matrix from a bias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.optim.registry import OPTIMIZERS


def _blocks(model: nn.Module) -> nn.Module | None:
    """The transformer blocks (``model.layers``) under DDP's ``module`` or compile's
    ``_orig_mod``, if the model has them."""
    for _ in range(3):
        if isinstance(getattr(model, "layers", None), nn.Module):
            return model.layers
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


def param_groups(
    model: nn.Module, weight_decay: float, split_hidden: bool = False
) -> list[dict[str, Any]]:
    """Split trainable params into a decayed group (>= 2-D) and an undecayed one (< 2-D);
    with ``split_hidden`` the >= 2-D ones inside transformer blocks form a group of their own
    first (Muon's), the embeddings and the head stay ``matrix``.

    As in nanoGPT: matmul weights and embeddings decay; biases and norm gains do not, since
    shrinking them towards zero only fights the normalisation. ``parameters()`` yields a
    tied weight once, so it lands in one group once. Empty groups are dropped.
    """
    blocks = _blocks(model) if split_hidden else None
    in_blocks = {id(p) for p in blocks.parameters()} if blocks is not None else set()
    hidden, decay, no_decay = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2:
            no_decay.append(p)
        else:
            (hidden if id(p) in in_blocks else decay).append(p)
    groups = [
        {"params": hidden, "weight_decay": weight_decay, "kind": "hidden"},
        {"params": decay, "weight_decay": weight_decay, "kind": "matrix"},
        {"params": no_decay, "weight_decay": 0.0, "kind": "vector"},
    ]
    return [g for g in groups if g["params"]]


def optimizer_param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """:func:`param_groups` as optimizer ``cfg.name`` needs them."""
    spec = OPTIMIZERS.get(cfg.name)
    return param_groups(
        model, cfg.weight_decay, split_hidden=spec is not None and spec.split_hidden
    )


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` over ``model``'s trainable params, split by :func:`param_groups`."""
    return optimizer_for_groups(optimizer_param_groups(model, cfg), cfg)


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
    return OPTIMIZERS[cfg.name].build(groups, cfg)
