"""Bytes autograd saves for backward, counted with saved-tensor hooks, and labels that say
which part of the model saved them (``saved_as``: attention marks its kernel's tensors)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from llm.memory.storage import local_shard

# The label of the code running now; saved-tensor hooks read it when autograd saves a tensor.
_LABEL: ContextVar[str | None] = ContextVar("saved_tensor_label", default=None)


@contextmanager
def saved_as(label: str) -> Iterator[None]:
    """Tensors autograd saves inside this block are counted under ``label`` as well (by the
    counter below and the peak tracker). Not entered while torch.compile traces: compiled
    code is not measured this way (docs/design.md)."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def current_label() -> str | None:
    return _LABEL.get()


class ActivationMemoryCounter:
    """Counts bytes of tensors autograd saves for backward while the context is open.

    Use around a forward pass: ``with ActivationMemoryCounter() as c: loss = model(x)``, then
    ``c.bytes``, and ``c.by_label`` for the part saved inside ``saved_as`` blocks. Each
    storage counts once (a saved view and its base, or one input saved by two ops, are one
    allocation); a storage saved both inside and outside a label counts under the label.
    Parameters saved by matmuls are counted too, since autograd keeps them alive for
    backward; subtract ``model_state_bytes()["params"]`` if you only want activations.
    Inside a non-reentrant checkpointed block torch installs its own hooks, so only what the
    checkpoint really keeps (the block inputs) reaches this counter.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.by_label: dict[str, int] = {}
        self._seen: set[StorageWeakRef] = set()
        self._labelled: set[StorageWeakRef] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local_shard(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in self._seen:
            self._seen.add(ref)
            self.bytes += storage.nbytes()
        label = _LABEL.get()
        if label is not None and ref not in self._labelled:
            self._labelled.add(ref)
            self.by_label[label] = self.by_label.get(label, 0) + storage.nbytes()
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
