"""Op-level selective activation checkpointing (torchtitan's ``_apply_op_sac``).

Each block runs under a non-reentrant checkpoint whose ``context_fn`` is torch's
``create_selective_checkpoint_contexts``: the outputs of the linear matmuls (aten.mm,
addmm, bmm) and of the attention kernels are MUST_SAVE, everything else (norms,
activations, RoPE, dropout, residual adds) PREFER_RECOMPUTE. With ``save_every_other_mm``
only the 1st, 3rd, 5th ... mm/addmm of a block's forward are kept, as torchtitan does.

Determinism: torch 2.13 calls the policy in the forward only, and the recomputation takes
each op's cached output or recomputes it by the op's invocation index, so the decision for
an mm cannot differ between forward and recompute. The counter is per block call (a new
context per forward), so every micro-batch and every layer starts at the first mm. The RNG
state is restored around the recomputation, so dropout masks match.

SAC caches the tensors it saves itself, not through saved-tensor hooks, so the activation
counter and the peak tracker would not see them: the policy hands each saved output to
them (``llm.memory.kept_for_backward``) and keeps the handles as long as the checkpoint's
contexts live (until the block's backward is done).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llm.memory import kept_for_backward
from llm.recompute.policies import NoRecompute, blocks

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default)  # the linear layers' matmuls
# Attention kernels whose outputs (and log-sum-exp) are kept; bmm is eager attention's
# QK^T and PV. flash_attn registers its kernels as torch ops when it is installed.
SAVED = {
    *MATMULS,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
for _name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
    _op = getattr(getattr(torch.ops, "flash_attn", None), _name, None)
    if _op is not None:
        SAVED.add(_op.default)


def _tensors(out) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _policy(save_every_other_mm: bool, handles: list) -> Callable:
    mm_count = 0

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        nonlocal mm_count
        save = func in SAVED
        if func in MATMULS:
            mm_count += 1
            save = not (save_every_other_mm and mm_count % 2 == 0)
        if not save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        for t in _tensors(ctx.op_output):
            handles.extend(kept_for_backward(t))
        return CheckpointPolicy.MUST_SAVE

    return policy


def _contexts(save_every_other_mm: bool):
    """A new pair of SAC contexts per block call; the memory handles live with them."""
    handles: list = []
    forward, recompute = create_selective_checkpoint_contexts(_policy(save_every_other_mm, handles))
    recompute.memory_handles = handles
    return forward, recompute


class OpSAC(NoRecompute):
    def __init__(self, save_every_other_mm: bool = False) -> None:
        self.save_every_other_mm = save_every_other_mm

    def apply(self, model: nn.Module) -> nn.Module:
        layers = blocks(model, "op_sac")
        every_other = self.save_every_other_mm
        for key, block in list(layers.named_children()):
            wrapped = checkpoint_wrapper(
                block,
                checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=lambda: _contexts(every_other),
            )
            setattr(layers, key, wrapped)
        return model
