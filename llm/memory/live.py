"""The ledger of live storages on one device that the peak tracker reads.

Every storage it has seen is an entry (weakly referenced: a storage's death subtracts its
bytes) with a size and a category; ``totals`` holds the live bytes per category and
``current`` their sum after every change. Three ways in: op outputs (``OpOutputs``, a
TorchDispatchMode), tensors kept for backward (``keep``, a saver of llm.memory.activations:
"activations" while autograd or a checkpoint's cache holds them), and the state a strategy
names (``classify``). Sizes are re-read, never trusted from registration: ZeRO-3 and FSDP2 free
and refill storages in place with ``untyped_storage().resize_()``, which no dispatch mode
sees, so ``wrap_resize`` wraps it while tracking. On CUDA a size is rounded up to the caching
allocator's 512-byte blocks.
"""

from __future__ import annotations

import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from llm.memory.activations import current_label

STATE = ("params", "grads", "optimizer_states")
CATEGORIES = (*STATE, "activations", "other")
CUDA_BLOCK = 512  # the caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp)

_PLAIN = (torch.Tensor, torch.nn.Parameter)

# The ledgers that re-read sizes after a resize_ while they track, and the resize_ that was
# installed when the first of them began (torch's own, or another tool's wrapper of it, such
# as torch's MemTracker): ours calls it, and the last ledger to stop puts it back.
_RESIZE_WATCHERS: list[LiveStorages] = []
_RESIZE_INNER: list = []


def _resize_and_remeasure(storage, *args, **kwargs):
    """The resize_ installed before ours, called first with the caller's arguments exactly:
    the same return value (the storage itself) and the same exceptions, before any ledger
    sees the call. Then every tracking ledger re-reads the storage's size."""
    out = _RESIZE_INNER[0](storage, *args, **kwargs)
    for ledger in _RESIZE_WATCHERS:
        ledger.resized(storage)
    return out


class Entry:
    """One live storage: its bytes now, its category, how many saved tensors hold it, and
    whether attention saved it."""

    __slots__ = ("attention", "category", "key", "ref", "saved", "size")


class _Saved:
    """The ledger's handle on a tensor kept for backward; its life is autograd's (or
    selective checkpointing's cache's) hold on the tensor."""

    __slots__ = ("entries", "ledger")

    def __init__(self, entries, ledger) -> None:
        self.entries, self.ledger = entries, ledger

    def __del__(self) -> None:
        for entry in self.entries:
            self.ledger.release(entry)


def origin(op) -> str:
    """``op`` and the innermost line of llm/ that ran it (not this room's, nor another
    dispatch mode's, such as the communication counter's): where a storage was made, as a
    peak's tensors name it."""
    frame = inspect.currentframe()
    while frame is not None:
        name, code = frame.f_code.co_filename, frame.f_code.co_name
        ours = f"{os.sep}llm{os.sep}" in name and f"{os.sep}memory{os.sep}" not in name
        if ours and code != "__torch_dispatch__":
            where = name.split(f"{os.sep}llm{os.sep}")[-1]
            return f"{op} at llm/{where}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return str(op)


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: a DTensor's local shard, a float8 tensor's data and scale."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    else:
        yield t.untyped_storage()


class OpOutputs(TorchDispatchMode):
    """Registers the storage of every op output with the ledger."""

    def __init__(self, ledger: LiveStorages) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor, float8: their inner ops on plain tensors return
        out = func(*args, **(kwargs or {}))
        if types and any(t not in _PLAIN for t in types):
            return out  # fake tensors (DTensor's sharding propagation) hold no memory
        if self.ledger.origins is not None:
            self.ledger.op = func
        see = self.ledger.see
        if isinstance(out, torch.Tensor):
            see(out)
        elif isinstance(out, tuple | list):
            for t in out:
                if isinstance(t, torch.Tensor):
                    see(t)
        return out


class LiveStorages:
    """Live bytes per category. ``on_high`` is called whenever ``current`` grows past
    ``threshold`` (the tracker sets it to the running peak while a phase is open)."""

    def __init__(self, device: torch.device, on_high: Callable[[], None]) -> None:
        self.device = torch.device(device)
        self.on_high = on_high
        self.threshold = math.inf
        self.live: dict[int, Entry] = {}
        self.other: dict[int, Entry] = {}  # entries in "other": reclassified at phase end
        self._state: dict[int, Entry] = {}
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.attention = 0  # bytes of saved storages attention saved (part of activations)
        self.current = 0
        # The most bytes of each category live at once since the tracker last set it: a
        # pipeline stage holds its most activations, and a strategy its most gradients, at
        # other moments than its highest total.
        self.high = dict.fromkeys(CATEGORIES, 0)
        # Where each storage was made (``origin``), kept only when a caller asks for it.
        self.origins: dict[int, str] | None = None
        self.op = None  # the op whose outputs are being registered

    def nbytes(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        if self.device.type == "cuda":
            return -(-n // CUDA_BLOCK) * CUDA_BLOCK
        return n

    def entry(self, storage: torch.UntypedStorage) -> Entry | None:
        """The storage's entry, registered (as "other") on first sight; None off-device."""
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None:
            if storage.device.type != self.device.type:
                return None
            entry = Entry()
            entry.key, entry.size, entry.category, entry.saved = key, 0, "other", 0
            entry.attention = False
            entry.ref = weakref.ref(storage, partial(self._free, key))
            self.live[key] = self.other[key] = entry
            if self.origins is not None:
                self.origins[key] = origin(self.op)
            self.grow(entry, self.nbytes(storage))
        return entry

    def see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        entry = self.live.get(storage._cdata)
        if entry is None:
            self.entry(storage)
        else:  # an in-place op may have resized it
            self.grow(entry, self.nbytes(storage))

    def grow(self, entry: Entry, size: int) -> None:
        delta = size - entry.size
        if delta:
            entry.size = size
            self.attention += delta if entry.attention else 0
            self.totals[entry.category] += delta
            self.current += delta
            if delta > 0:
                self._note(entry.category)
            if delta > 0 and self.current > self.threshold:
                self.on_high()

    def _free(self, key: int, _ref) -> None:
        entry = self.live.pop(key, None)
        if self.origins is not None:
            self.origins.pop(key, None)
        if entry is not None:
            self.other.pop(key, None)
            self._state.pop(key, None)
            self.totals[entry.category] -= entry.size
            self.current -= entry.size
            self.attention -= entry.size if entry.attention else 0

    def move(self, entry: Entry, category: str) -> None:
        if entry.category == category:
            return
        if entry.category == "other":
            del self.other[entry.key]
        elif category == "other":
            self.other[entry.key] = entry
        self.totals[entry.category] -= entry.size
        self.totals[category] += entry.size
        entry.category = category
        self._note(category)

    def _note(self, category: str) -> None:
        self.high[category] = max(self.high[category], self.totals[category])

    def remeasure(self) -> None:
        """Sizes may have changed while nothing was tracked (storages resized in place)."""
        for entry in list(self.live.values()):
            storage = entry.ref()
            if storage is not None:
                self.grow(entry, self.nbytes(storage))

    def wrap_resize(self) -> None:
        """Re-read a storage's size whenever it is resized in place, until ``unwrap_resize``.
        One patch serves every ledger, installed while any tracks and wrapping whatever
        resize_ was there before it (another tool's wrapper keeps seeing every resize), so
        ledgers that start and stop in any order leave that method behind."""
        if self not in _RESIZE_WATCHERS:
            _RESIZE_WATCHERS.append(self)
        if not _RESIZE_INNER:
            _RESIZE_INNER.append(torch.UntypedStorage.resize_)
            torch.UntypedStorage.resize_ = _resize_and_remeasure

    def unwrap_resize(self) -> None:
        if self in _RESIZE_WATCHERS:
            _RESIZE_WATCHERS.remove(self)
        if not _RESIZE_WATCHERS and _RESIZE_INNER:
            torch.UntypedStorage.resize_ = _RESIZE_INNER.pop()

    def resized(self, storage: torch.UntypedStorage) -> None:
        entry = self.live.get(storage._cdata)
        if entry is not None:
            self.grow(entry, self.nbytes(storage))

    # ---- state and activations ---------------------------------------------------------
    def classify(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Put the storages ``state`` names under their category; storages it named last
        time and no longer does go back to activations (if saved) or other."""
        named: dict[int, tuple[Entry, str]] = {}
        for category in STATE:
            for t in state.get(category, ()):
                if t is None:
                    continue
                for storage in storages(t):
                    entry = self.entry(storage)
                    if entry is not None and entry.key not in named:
                        self.grow(entry, self.nbytes(storage))
                        named[entry.key] = (entry, category)
        for key, entry in list(self._state.items()):
            if key not in named:
                self.move(entry, "activations" if entry.saved else "other")
        for entry, category in named.values():
            self.move(entry, category)
        self._state = {key: entry for key, (entry, _) in named.items()}

    def keep(self, t: torch.Tensor) -> _Saved | None:
        """``t`` is kept for backward (a saver, llm.memory.activations): its storages count as
        activations while the returned handle lives."""
        entries = [e for s in storages(t) if (e := self.entry(s)) is not None]
        if not entries:
            return None
        by_attention = current_label() == "attention"
        for entry in entries:
            entry.saved += 1
            if by_attention and not entry.attention:
                entry.attention = True
                self.attention += entry.size
            if entry.category == "other":
                self.move(entry, "activations")
        return _Saved(entries, self)

    def release(self, entry: Entry) -> None:
        entry.saved -= 1
        # A saved leaf whose .data was swapped (DeepSpeed ZeRO-3 releasing a gathered
        # parameter) may have lost its storage already: its bytes left with it.
        if entry.saved or self.live.get(entry.key) is not entry:
            return
        if entry.attention:
            entry.attention = False
            self.attention -= entry.size
        if entry.category == "activations":
            self.move(entry, "other")
