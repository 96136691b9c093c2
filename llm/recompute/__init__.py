"""Activation recompute policies, applied to a built model before parallelism wraps it.

A policy is a small object (torchtitan's ``activation_checkpoint.py`` shape) with
``apply(model) -> model``, run once on the meta-device model, and ``forward_context()``, a
context the Trainer enters around every training forward (a policy that acts while the
forward runs, not on the model, uses it; the Trainer never branches on the policy's name).
``RECOMPUTE_POLICIES`` maps ``recompute.name`` to a factory taking the config:

- ``none``: keep every activation.
- ``full``: checkpoint whole blocks (``every``: every k-th block), keeping their inputs.
- ``selective``: recompute only the attention core (Korthikanti et al. 2022).
- ``op_sac``: op-level selective checkpointing: keep matmul and attention-kernel outputs,
  recompute the rest (torchtitan's op SAC).
- ``budget``: torch.compile's min-cut partitioner picks what to keep under a memory budget.
- ``offload``: keep every activation, in pinned host memory.

docs/recompute.md says what each keeps and how to pick one.

May import llm.config, llm.memory and llm.errors.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from llm.config import RecomputeConfig
from llm.errors import ConfigError
from llm.recompute.op_sac import OpSAC
from llm.recompute.policies import (
    BudgetRecompute,
    FullRecompute,
    NoRecompute,
    OffloadRecompute,
    RecomputePolicy,
    SelectiveRecompute,
)

RECOMPUTE_POLICIES: dict[str, Callable[[RecomputeConfig], RecomputePolicy]] = {
    "none": lambda cfg: NoRecompute(),
    "full": lambda cfg: FullRecompute(every=cfg.every),
    "selective": lambda cfg: SelectiveRecompute(),
    "op_sac": lambda cfg: OpSAC(save_every_other_mm=cfg.save_every_other_mm),
    "budget": lambda cfg: BudgetRecompute(cfg.memory_budget),
    "offload": lambda cfg: OffloadRecompute(),
}

__all__ = ["RECOMPUTE_POLICIES", "RecomputePolicy", "apply_recompute", "recompute_policy"]


def recompute_policy(cfg: RecomputeConfig) -> RecomputePolicy:
    """The policy object ``cfg.name`` names."""
    if cfg.name not in RECOMPUTE_POLICIES:
        raise ConfigError(
            f"recompute.name={cfg.name!r} is unknown; choose one of {', '.join(RECOMPUTE_POLICIES)}"
        )
    return RECOMPUTE_POLICIES[cfg.name](cfg)


def apply_recompute(
    model: nn.Module, cfg: RecomputeConfig, policy: RecomputePolicy | None = None
) -> nn.Module:
    """Apply the recompute policy ``cfg.name`` (or the ``policy`` built from it already) to
    ``model`` in place and return it."""
    return (policy or recompute_policy(cfg)).apply(model)
