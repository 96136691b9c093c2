"""Op-level selective activation checkpointing (torchtitan's ``_apply_op_sac``).

Each block runs under a non-reentrant checkpoint whose ``context_fn`` is torch's
``create_selective_checkpoint_contexts``: the outputs of the linear matmuls (aten.mm,
addmm, bmm) and of the attention kernels are MUST_SAVE, everything else (norms,
activations, RoPE, dropout, residual adds) PREFER_RECOMPUTE. With ``save_every_other_mm``
only the 1st, 3rd, 5th ... mm/addmm of a block's forward are kept, as torchtitan does.

Determinism: torch 2.13 calls the policy in the forward only, and the recomputation takes
each op's cached output or recomputes it by the op's invocation index, so the decision for
an mm cannot differ between forward and recompute. Older releases (2.11, 2.12) call the
policy again in the recompute, before each op: the mm count is kept per pass (as torchtitan
does), so the recompute decides as the forward did. The counter is per block call (a new
context per forward), so every micro-batch and every layer starts at the first mm. The RNG
state is restored around the recomputation, so dropout masks match.

SAC caches the tensors it saves itself, not through saved-tensor hooks, so the activation
counter and the peak tracker would not see them: the policy hands each saved output to
them (``llm.memory.kept_for_backward``) and keeps the handles as long as the checkpoint's
contexts live (until the block's backward is done). torch 2.12 and later hand the policy
each op's output (``ctx.op_output``); on 2.11, whose policy runs before the op, the forward's
caching mode hands over what it has just cached instead (``_HandOverCached``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

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
# xFormers' forwards (attention=xformers): its FlashAttention-2/3 ops, matched by name as
# they are registered only when xformers.ops is imported, and torch's CUTLASS kernel (fp32).
SAVED.add(aten._efficient_attention_forward.default)
SAVED_NAMES = {"xformers_flash::flash_fwd", "xformers_flash3::flash_fwd"}


def _tensors(out) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


# torch 2.12 and later call the policy after the op with its output; 2.11 before, without.
POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _policy(save_every_other_mm: bool, handles: list) -> Callable:
    mm_count = {False: 0, True: 0}  # by ctx.is_recompute: torch < 2.13 asks in both passes

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        save = func in SAVED or getattr(getattr(func, "_schema", None), "name", None) in SAVED_NAMES
        if func in MATMULS:
            mm_count[ctx.is_recompute] += 1
            save = not (save_every_other_mm and mm_count[ctx.is_recompute] % 2 == 0)
        if not save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if POLICY_SEES_OUTPUT:  # else _HandOverCached hands it over once the op has run
            for t in _tensors(ctx.op_output):
                handles.extend(kept_for_backward(t))
        return CheckpointPolicy.MUST_SAVE

    return policy


def _contexts(save_every_other_mm: bool):
    """A new pair of SAC contexts per block call; the memory handles live with them."""
    handles: list = []
    forward, recompute = create_selective_checkpoint_contexts(_policy(save_every_other_mm, handles))
    if not POLICY_SEES_OUTPUT:
        forward.__class__ = _HandOverCached  # the same mode, one step added
        forward.memory_handles = handles
    recompute.memory_handles = handles
    return forward, recompute


if not POLICY_SEES_OUTPUT:
    # torch 2.11: no public hook of its sees an op's output, so the forward's caching mode
    # (what create_selective_checkpoint_contexts returns first) hands over what it has just
    # cached, as the policy does itself where it sees ``ctx.op_output``.
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    class _HandOverCached(_CachingTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            cached = len(self.storage.get(func, ()))
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if len(self.storage.get(func, ())) > cached:  # the policy saved it
                for t in _tensors(out):
                    self.memory_handles.extend(kept_for_backward(t))
            return out


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
