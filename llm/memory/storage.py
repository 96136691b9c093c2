"""Bytes that exist: distinct tensor storages, and a model's parameters, gradients and
optimizer states counted from them (never estimated)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# A weak, hashable handle on a storage keyed by its StorageImpl address. While we hold it
# the address cannot be reused, so two handles are equal exactly when the storages are one.
# Unlike data_ptr() it also tells apart meta storages, which all have data_ptr 0.
from torch.multiprocessing.reductions import StorageWeakRef

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds: a DTensor's local tensor, any other tensor itself."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: the local shard).

    Views, tied weights and params packed into one flat buffer count once, and a view counts
    its whole storage: that is what stays allocated. ``None`` is skipped. Meta tensors count
    the bytes their storage will take once materialised, so a model can be sized before it
    exists.
    """
    seen: set[StorageWeakRef] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_shard(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in seen:
            seen.add(ref)
            total += storage.nbytes()
    return total


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for params, grads and optimizer states, from tensor storages.

    Optimizer states are every tensor in ``optimizer.state`` (AdamW's exp_avg, exp_avg_sq
    and its scalar ``step`` tensors alike); non-tensor entries (plain-float steps) hold no
    device memory and are skipped.
    """
    params = list(model.parameters())
    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer_states": storage_bytes(states),
    }
