"""Bytes autograd saves for backward, counted with saved-tensor hooks, with labels that say
which part of the model saved them (``saved_as``: attention marks its kernel's tensors;
``in_layer``: the transformer block running).

Torch applies only the innermost pair of saved-tensor hooks, so every measurer (the
activation counter here, the peak tracker's ledger) registers as a *saver* and one pair of
hooks hands each saved tensor to all savers open now. Tensors kept for backward without
going through saved-tensor hooks (selective activation checkpointing's cache) are handed
to the same savers with :func:`kept_for_backward`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from llm.memory.storage import local_shard

OUTSIDE = "outside"  # the layer label of tensors saved outside every block

# The label of the code running now; saved-tensor hooks read it when autograd saves a tensor.
_LABEL: ContextVar[str | None] = ContextVar("saved_tensor_label", default=None)
_LAYER: ContextVar[str] = ContextVar("saved_tensor_layer", default=OUTSIDE)


class Saver(Protocol):
    def keep(self, t: torch.Tensor) -> object | None:
        """``t`` is kept for backward; the returned handle (if any) lives as long as it is."""


_SAVERS: ContextVar[tuple[Saver, ...]] = ContextVar("savers", default=())


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


def current_layer() -> str:
    return _LAYER.get()


class _Packed:
    """What the pack hook hands autograd: the tensor and the savers' handles, which live as
    long as autograd holds it."""

    __slots__ = ("handles", "tensor")

    def __init__(self, tensor: torch.Tensor, handles: tuple) -> None:
        self.tensor, self.handles = tensor, handles


def kept_for_backward(t: torch.Tensor) -> tuple:
    """Tell every open saver that ``t`` is kept for backward; keep the returned handles as
    long as ``t`` is kept."""
    return tuple(h for saver in _SAVERS.get() if (h := saver.keep(t)) is not None)


def _pack(t: torch.Tensor):
    handles = kept_for_backward(t)
    # A saved op output holding itself would tie it to its own grad_fn in a cycle; a
    # detached alias shares its storage and version counter. Leaves are kept as they are,
    # as autograd does, so a strategy that swaps a parameter's .data (DeepSpeed ZeRO-3)
    # still sees it.
    held = t if t.grad_fn is None else t.detach()
    return _Packed(held, handles) if handles else held


def _unpack(packed) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Packed) else packed


@contextmanager
def saving_to(saver: Saver) -> Iterator[None]:
    """Hand ``saver`` every tensor kept for backward while open, beside the savers already
    open."""
    token = _SAVERS.set((*_SAVERS.get(), saver))
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _SAVERS.reset(token)


class _LayerLabels:
    """Forward hooks on each block that set the layer label while the block runs forward."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self._handles = []
        for i, block in enumerate(layers):
            self._handles.append(block.register_forward_pre_hook(self._enter(f"layers.{i}")))
            self._handles.append(block.register_forward_hook(self._exit, always_call=True))
        self._tokens: list = []

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self._tokens.append(_LAYER.set(name))

        return hook

    def _exit(self, module, args, output) -> None:
        _LAYER.reset(self._tokens.pop())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def find_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's ``layers`` (the blocks), under any wrapper (DDP's ``module.``,
    torch.compile's ``_orig_mod.``, DeepSpeed's engine)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return module
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a matmul saves ``weight.t()``, a view)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationMemoryCounter:
    """Counts bytes of tensors kept for backward while the context is open.

    Use around a forward pass: ``with ActivationMemoryCounter() as c: loss = model(x)``, then
    ``c.bytes``, and ``c.by_label`` for the part saved inside ``saved_as`` blocks. Each
    storage counts once (a saved view and its base, or one input saved by two ops, are one
    allocation); a storage saved both inside and outside a label counts under the label.
    ``bytes`` includes parameters saved by matmuls (autograd keeps them alive for backward).

    Activations, parameters (``nn.Parameter`` and views of one) excluded, are counted per layer when the
    counter is given the model's blocks (``layers``): ``by_layer`` maps ``layers.{i}`` and
    ``outside`` (embeddings, final norm, head, loss) to bytes; a storage counts in the layer
    that saved it first. ``activation_bytes`` is their sum.

    Inside a non-reentrant checkpointed block torch installs its own hooks, so only what the
    checkpoint really keeps (the block inputs) reaches this counter, plus what selective
    activation checkpointing caches (handed over with ``kept_for_backward``).
    """

    def __init__(self, layers: nn.ModuleList | None = None) -> None:
        self.bytes = 0
        self.by_label: dict[str, int] = {}
        names = [f"layers.{i}" for i in range(len(layers))] if layers is not None else []
        self.by_layer: dict[str, int] = dict.fromkeys([*names, OUTSIDE], 0)
        self._layers = layers
        self._seen: set[StorageWeakRef] = set()
        self._labelled: set[StorageWeakRef] = set()
        self._open: list = []

    @property
    def activation_bytes(self) -> int:
        return sum(self.by_layer.values())

    def keep(self, t: torch.Tensor) -> None:
        storage = local_shard(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in self._seen:
            self._seen.add(ref)
            self.bytes += storage.nbytes()
            if not _is_parameter(t):
                layer = _LAYER.get()
                self.by_layer[layer] = self.by_layer.get(layer, 0) + storage.nbytes()
        label = _LABEL.get()
        if label is not None and ref not in self._labelled:
            self._labelled.add(ref)
            self.by_label[label] = self.by_label.get(label, 0) + storage.nbytes()

    def __enter__(self) -> ActivationMemoryCounter:
        labels = _LayerLabels(self._layers) if self._layers is not None else None
        saving = saving_to(self)
        saving.__enter__()
        self._open = [labels, saving]
        return self

    def __exit__(self, *exc: object) -> None:
        labels, saving = self._open
        saving.__exit__(*exc)
        # Storage handles are only needed while counting; dropped now, they cannot outlive
        # torch at interpreter exit (a compiled graph may keep this counter alive).
        self._seen.clear()
        self._labelled.clear()
        if labels is not None:
            labels.remove()
