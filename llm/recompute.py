"""Activation recompute policies, applied to a built model before parallelism wraps it.

A policy is a small object with ``apply(model) -> model`` (torchtitan's
``activation_checkpoint.py`` shape); ``RECOMPUTE_POLICIES`` maps ``recompute.name`` to a
factory taking the config, so a ``selective`` policy (save matmuls, recompute the rest)
can be added beside ``full`` later.

``full`` wraps blocks with torch's ``checkpoint_wrapper`` in ``NO_REENTRANT`` mode rather
than a home-made wrapper, because:
- non-reentrant checkpointing works with inputs that do not require grad, keyword
  arguments, nested ``backward`` and FSDP2/DDP hooks; the reentrant mode does not;
- the wrapper strips its ``_checkpoint_wrapped_module.`` infix from ``state_dict`` keys and
  adds it back on load, so checkpoints and HF export see the same names with or without
  recompute (``model.named_parameters()`` does show the infix; use state_dict keys for
  anything that must match across policies);
- it forwards attribute access to the wrapped block, so code reading ``block.attn`` works;
- wrapping only re-parents modules, it never reads or copies tensors, so it is safe on a
  meta-device model before weights are materialised.
The RNG state is saved and restored around the recomputation (torch's default), so
dropout masks match and gradients equal those without recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from llm.config import RecomputeConfig
from llm.errors import ConfigError


class RecomputePolicy(Protocol):
    def apply(self, model: nn.Module) -> nn.Module: ...


class NoRecompute:
    """Keep every activation: the fastest backward and the most memory."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model


class FullRecompute:
    """Checkpoint whole transformer blocks: keep only each wrapped block's input.

    ``every=k`` wraps the k-th, 2k-th, ... block (indices k-1, 2k-1, ..., as torchtitan's
    ``ac_freq``), trading memory against recompute time in steps of 1/k.
    """

    def __init__(self, every: int = 1) -> None:
        self.every = every

    def apply(self, model: nn.Module) -> nn.Module:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError(
                f"recompute=full needs a model with .layers (an nn.ModuleList of blocks); "
                f"{type(model).__name__} has none, use recompute=none"
            )
        for i, block in enumerate(layers):
            if (i + 1) % self.every == 0:
                layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return model


RECOMPUTE_POLICIES: dict[str, Callable[[RecomputeConfig], RecomputePolicy]] = {
    "none": lambda cfg: NoRecompute(),
    "full": lambda cfg: FullRecompute(every=cfg.every),
}


def apply_recompute(model: nn.Module, cfg: RecomputeConfig) -> nn.Module:
    """Apply the recompute policy ``cfg.name`` to ``model`` (in place) and return it."""
    if cfg.name not in RECOMPUTE_POLICIES:
        raise ConfigError(
            f"recompute.name={cfg.name!r} is unknown; choose one of {', '.join(RECOMPUTE_POLICIES)}"
        )
    return RECOMPUTE_POLICIES[cfg.name](cfg).apply(model)
