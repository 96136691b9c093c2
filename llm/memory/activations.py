"""Bytes autograd saves for backward, counted with saved-tensor hooks."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from llm.memory.storage import local_shard


class ActivationMemoryCounter:
    """Counts bytes of tensors autograd saves for backward while the context is open.

    Use around a forward pass: ``with ActivationMemoryCounter() as c: loss = model(x)``, then
    ``c.bytes``. Each storage counts once (a saved view and its base, or one input saved by
    two ops, are one allocation). Parameters saved by matmuls are counted too, since autograd
    keeps them alive for backward; subtract ``model_state_bytes()["params"]`` if you only
    want activations. Inside a non-reentrant checkpointed block torch installs its own hooks,
    so only what the checkpoint really keeps (the block inputs) reaches this counter.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[StorageWeakRef] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local_shard(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in self._seen:
            self._seen.add(ref)
            self.bytes += storage.nbytes()
        # detach: handing back the tensor itself would tie an op's output to its own
        # grad_fn in a reference cycle; the detached alias shares storage and version counter.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> ActivationMemoryCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
