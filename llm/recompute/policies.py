"""The recompute policies that need no op-level policy: none, full, selective, budget and
offload (op_sac is ``llm.recompute.op_sac``).

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
The RNG state is saved and restored around every recomputation (torch's default), so
dropout masks match and gradients equal those without recompute.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from llm.errors import ConfigError


class RecomputePolicy(Protocol):
    def apply(self, model: nn.Module) -> nn.Module:
        """Change ``model`` (on the meta device, before any strategy wraps it); return it."""

    def forward_context(self) -> AbstractContextManager:
        """Entered by the Trainer around every training forward."""


class NoRecompute:
    """Keep every activation: the fastest backward and the most memory."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def forward_context(self) -> AbstractContextManager:
        return contextlib.nullcontext()


def blocks(model: nn.Module, policy: str) -> nn.ModuleList | nn.ModuleDict:
    """The model's transformer blocks, or one line saying the policy needs them: a
    ModuleList, or a pipeline stage's ModuleDict keyed by the blocks' indices in the whole
    model. Either is indexed by ``str(index)`` for setattr."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
        raise ConfigError(
            f"recompute={policy} needs a model with .layers (an nn.ModuleList of blocks); "
            f"{type(model).__name__} has none, use recompute=none"
        )
    return layers


class FullRecompute(NoRecompute):
    """Checkpoint whole transformer blocks: keep only each wrapped block's input.

    ``every=k`` wraps the k-th, 2k-th, ... block (indices k-1, 2k-1, ..., as torchtitan's
    ``ac_freq``), trading memory against recompute time in steps of 1/k.
    """

    def __init__(self, every: int = 1) -> None:
        self.every = every

    def apply(self, model: nn.Module) -> nn.Module:
        layers = blocks(model, "full")
        for key, block in list(layers.named_children()):
            if (int(key) + 1) % self.every == 0:  # the block's index in the whole model
                wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                setattr(layers, key, wrapped)
        return model


class SelectiveRecompute(NoRecompute):
    """Recompute only the attention core (Korthikanti et al. 2022, "selective activation
    recomputation"): every module with a ``recompute_core`` flag (``llm.models.layers.
    Attention``) runs ``attention(q, k, v)`` under a non-reentrant checkpoint. Kept: q, k, v
    and what the rest of the block keeps; recomputed in backward: the scores, softmax and
    dropout (eager) or the fused kernel's forward, whose output and log-sum-exp are then not
    kept."""

    def apply(self, model: nn.Module) -> nn.Module:
        cores = [m for m in model.modules() if hasattr(m, "recompute_core")]
        if not cores:
            raise ConfigError(
                f"recompute=selective needs attention modules with a recompute_core flag; "
                f"{type(model).__name__} has none, use recompute=full"
            )
        for module in cores:
            module.recompute_core = True
        return model


class BudgetRecompute(NoRecompute):
    """torch.compile's min-cut partitioner chooses what to keep so that saved activations
    stay within ``budget`` (0: recompute all it can, 1: the default partition) of what the
    default partition keeps. The budget is read when AOTAutograd partitions a graph, which
    happens lazily at the first forward of each new graph (and at any recompilation), not at
    ``torch.compile()``; so it is set around every training forward instead of once, scoped
    so that no other compiled code in the process sees it."""

    def __init__(self, budget: float) -> None:
        self.budget = budget

    def forward_context(self) -> AbstractContextManager:
        return torch._functorch.config.patch(activation_memory_budget=self.budget)


class OffloadRecompute(NoRecompute):
    """Keep every activation, but in pinned host memory: each saved tensor is copied to the
    host in forward and back in backward (``torch.autograd.graph.save_on_cpu``), trading
    PCIe traffic for device memory. Needs a CUDA device (validated before ranks start)."""

    def forward_context(self) -> AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
