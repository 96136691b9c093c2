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


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (AdamW's exp_avg, exp_avg_sq and its scalar ``step``
    tensors alike); non-tensor entries (plain-float steps) hold no device memory."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def module_state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, list[torch.Tensor]]:
    """The params, grads and optimizer states of a model (a strategy's ``state_tensors()``
    when it holds whole or DTensor-sharded parameters)."""
    params = list(model.parameters())
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer_states": optimizer_state_tensors(optimizer),
    }


def state_bytes(state: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of each category of ``state_tensors()``, each storage once per category."""
    return {kind: storage_bytes(tensors) for kind, tensors in state.items()}


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for params, grads and optimizer states, from tensor storages."""
    return state_bytes(module_state_tensors(model, optimizer))
