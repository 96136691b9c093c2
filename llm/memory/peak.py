"""The high-water mark of live tensor bytes on one rank, by category and by phase.

While a window is open (a training step, start-up, a checkpoint save or load) a
TorchDispatchMode registers the storage of every op output on the tracked device (weakly:
a storage's death subtracts its bytes), so the tracker knows the live total after every op
and records the breakdown whenever it sets a new high. Categories:

- params, grads, optimizer_states: storages the strategy's ``state_tensors()`` names. Storages
  that existed before tracking began (the model state) are registered from that list, so
  they count too. The list is re-read at every phase boundary and when autograd finishes a
  backward (before DDP's, ZeRO's or DeepSpeed's end-of-backward work), so every strategy is
  classified at the same moments. A storage that is born and dies between two reads (a
  bucket reduced and freed during backward) is "other".
- activations: storages autograd saved for backward and still holds (saved-tensor hooks).
  Inside a non-reentrant checkpointed block torch's own hooks take over, so only what the
  checkpoint keeps (the block inputs) counts.
- activations_attention: the part of activations saved inside a ``saved_as("attention")``
  block (the attention kernels: llm.attention labels each call), a storage counted there
  if attention saved it at all; not a category of its own, so not added into the total.
- other: everything else registered: communication buckets, temporaries, gathered
  parameters the strategy does not list as state, gradients of activations.

Sizes are re-read, never trusted from registration: ZeRO-3 and FSDP2 free and refill
storages in place with ``untyped_storage().resize_()``, which no dispatch mode sees, so
``resize_`` is wrapped while a window is open and every live storage is re-measured when a
window opens. On CUDA a size is rounded up to the caching allocator's 512-byte blocks.

Not seen: storages that no op wrote or autograd saved while a window was open (model buffers
only read, an input batch copied before the step), memory outside tensors (cuBLAS
workspaces, NCCL buffers, allocator fragmentation), host tensors of a GPU run (offloaded
optimizer states). The backward's ops run in autograd's device threads on CUDA; autograd
carries the dispatch mode into them, so they are seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)

from llm.memory.activations import current_label
from llm.memory.process import cuda_peak_bytes

STATE = ("params", "grads", "optimizer_states")
CATEGORIES = (*STATE, "activations", "other")
LABELLED = "activations_attention"  # the peak's key for the part attention saved
MODES = ("logged", "every_step", "off")
CUDA_BLOCK = 512  # the caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp)

_PLAIN = (torch.Tensor, torch.nn.Parameter)
StateFn = Callable[[], dict[str, list[torch.Tensor]]]


class _Entry:
    """One live storage: its bytes now, its category, how many saved tensors hold it, and
    whether attention saved it."""

    __slots__ = ("attention", "category", "key", "ref", "saved", "size")


class _Saved:
    """What the pack hook hands autograd; its life is autograd's hold on the tensor."""

    __slots__ = ("entries", "tensor", "tracker")

    def __init__(self, tensor, entries, tracker) -> None:
        self.tensor, self.entries, self.tracker = tensor, entries, tracker

    def __del__(self) -> None:
        for entry in self.entries:
            self.tracker._release(entry)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: a DTensor's local shard, a float8 tensor's data and scale."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    else:
        yield t.untyped_storage()


class _OpOutputs(TorchDispatchMode):
    def __init__(self, tracker: PeakTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor, float8: their inner ops on plain tensors return
        out = func(*args, **(kwargs or {}))
        if types and any(t not in _PLAIN for t in types):
            return out  # fake tensors (DTensor's sharding propagation) hold no memory
        see = self.tracker._see
        if isinstance(out, torch.Tensor):
            see(out)
        elif isinstance(out, tuple | list):
            for t in out:
                if isinstance(t, torch.Tensor):
                    see(t)
        return out


class PeakTracker:
    """Per-rank peaks of live tensor bytes: of each tracked step (``last_step``), of every
    phase over the run (``by_phase``), and the tracked step with the highest total
    (``best_step``). Each peak is {params, grads, optimizer_states, activations, other,
    total, phase}. On CUDA the allocator's own peak is read beside it (``last_cuda_peak``,
    reset at each step start)."""

    def __init__(self, device: torch.device, mode: str = "logged") -> None:
        self.device = torch.device(device)
        self.mode = mode
        self._state_fn: StateFn | None = None
        self._live: dict[int, _Entry] = {}
        self._other: dict[int, _Entry] = {}  # entries in "other": reclassified at phase end
        self._state: dict[int, _Entry] = {}
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.attention = 0  # bytes of saved storages attention saved (part of activations)
        self.current = 0
        self._phase: str | None = None
        self._peak_total = 0
        self._peak: tuple = ()
        self._step_peak: dict | None = None
        self._mode = _OpOutputs(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._resize = None
        self._open: ExitStack | None = None
        self.last_step: dict | None = None
        self.best_step: dict | None = None
        self.by_phase: dict[str, dict] = {}
        self.last_cuda_peak: int | None = None
        self.cuda_step_peak: int | None = None  # the highest per-step allocator peak
        self.cuda_run_peak: int | None = None  # over steps, start-up and checkpoints

    # ---- what the caller drives --------------------------------------------------------
    def watch(self, state_fn: StateFn) -> None:
        """Where params, grads and optimizer states come from (a strategy's state_tensors)."""
        self._state_fn = state_fn

    def tracks(self, logged: bool) -> bool:
        """Whether a step is tracked under this mode (``logged``: the step is logged)."""
        return self.mode == "every_step" or (self.mode == "logged" and logged)

    @contextmanager
    def step(self, tracked: bool) -> Iterator[None]:
        """One training step; its phases are named with ``phase()``, starting at forward."""
        self._reset_cuda_peak()
        self.last_step = None
        if tracked:
            with self._window("forward"):
                yield
            self.last_step = self._step_peak
            if self.best_step is None or self.last_step["total"] > self.best_step["total"]:
                self.best_step = self.last_step
        else:
            yield
        self.last_cuda_peak = self._read_cuda_peak()
        self.cuda_step_peak = _max(self.cuda_step_peak, self.last_cuda_peak)

    def begin(self, phase: str) -> bool:
        """Open a window that is one phase of its own (start-up, a checkpoint save or load)
        until ``end()``. Nothing when tracking is off or a window is open; returns whether
        it opened one."""
        if self.mode == "off" or self._phase is not None:
            return False
        self._reset_cuda_peak()
        self._open = ExitStack()
        self._open.enter_context(self._window(phase))
        return True

    def end(self) -> None:
        """Close the window ``begin()`` opened (nothing if none is open): safe in a finally."""
        if self._open is not None:
            window, self._open = self._open, None
            window.close()
            self._read_cuda_peak()

    @contextmanager
    def region(self, phase: str) -> Iterator[None]:
        """``begin(phase)`` ... ``end()`` around a block."""
        opened = self.begin(phase)
        try:
            yield
        finally:
            if opened:
                self.end()

    def phase(self, name: str) -> None:
        """Close the running phase's peak and open ``name`` (nothing outside a window)."""
        if self._phase is not None and self._phase != name:
            self._close_phase()
            self._open_phase(name)

    def watch_backward(self, loss: torch.Tensor) -> None:
        """Re-read the state when autograd finishes the backward from ``loss``: before the
        strategy's end-of-backward work reduces and frees full gradients."""
        if self._phase is not None and loss.requires_grad:
            loss.register_hook(self._queue_refresh)

    # ---- windows and phases ------------------------------------------------------------
    @contextmanager
    def _window(self, phase: str) -> Iterator[None]:
        self._step_peak = None
        self._wrap_resize()
        try:
            self._remeasure()
            self._open_phase(phase)
            with self._mode, self._hooks:
                yield
        finally:
            torch.UntypedStorage.resize_ = self._resize
            if self._phase is not None:
                self._close_phase()

    def _open_phase(self, name: str) -> None:
        self._phase = name
        self._refresh()
        self._record()

    def _close_phase(self) -> None:
        self._refresh()
        peak = self._finish()
        self._phase = None
        if self._step_peak is None or peak["total"] > self._step_peak["total"]:
            self._step_peak = peak
        best = self.by_phase.get(peak["phase"])
        if best is None or peak["total"] > best["total"]:
            self.by_phase[peak["phase"]] = peak

    def _record(self) -> None:
        self._peak_total = self.current
        others = [(e, e.size) for e in self._other.values()]
        self._peak = (dict(self.totals), others, self._phase, self.attention)

    def _finish(self) -> dict:
        """The phase's peak, with storages that were unclassified at the peak and have since
        turned out to be state (gradients made during backward) moved to their category."""
        totals, others, phase, attention = self._peak
        for entry, size in others:
            if entry.category in STATE:
                totals["other"] -= size
                totals[entry.category] += size
        return {**totals, "total": sum(totals.values()), "phase": phase, LABELLED: attention}

    # ---- storages ----------------------------------------------------------------------
    def _bytes(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        if self.device.type == "cuda":
            return -(-n // CUDA_BLOCK) * CUDA_BLOCK
        return n

    def _entry(self, storage: torch.UntypedStorage) -> _Entry | None:
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            if storage.device.type != self.device.type:
                return None
            entry = _Entry()
            entry.key, entry.size, entry.category, entry.saved = key, 0, "other", 0
            entry.attention = False
            entry.ref = weakref.ref(storage, partial(self._free, key))
            self._live[key] = self._other[key] = entry
            self._grow(entry, self._bytes(storage))
        return entry

    def _see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._entry(storage)
        else:  # an in-place op may have resized it
            self._grow(entry, self._bytes(storage))

    def _grow(self, entry: _Entry, size: int) -> None:
        delta = size - entry.size
        if delta:
            entry.size = size
            self.attention += delta if entry.attention else 0
            self.totals[entry.category] += delta
            self.current += delta
            if delta > 0 and self._phase is not None and self.current > self._peak_total:
                self._record()

    def _free(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._other.pop(key, None)
            self._state.pop(key, None)
            self.totals[entry.category] -= entry.size
            self.current -= entry.size
            self.attention -= entry.size if entry.attention else 0

    def _move(self, entry: _Entry, category: str) -> None:
        if entry.category == category:
            return
        if entry.category == "other":
            del self._other[entry.key]
        elif category == "other":
            self._other[entry.key] = entry
        self.totals[entry.category] -= entry.size
        self.totals[category] += entry.size
        entry.category = category

    def _remeasure(self) -> None:
        """Sizes may have changed while no window was open (storages resized in place)."""
        for entry in list(self._live.values()):
            storage = entry.ref()
            if storage is not None:
                self._grow(entry, self._bytes(storage))

    def _wrap_resize(self) -> None:
        self._resize = resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = resize(storage, size)
            entry = tracker._live.get(storage._cdata)
            if entry is not None:
                tracker._grow(entry, tracker._bytes(storage))
            return out

        torch.UntypedStorage.resize_ = resize_

    # ---- state and activations ---------------------------------------------------------
    def _refresh(self) -> None:
        """Classify the storages the strategy names as state now."""
        state = self._state_fn() if self._state_fn is not None else {}
        named: dict[int, tuple[_Entry, str]] = {}
        for category in STATE:
            for t in state.get(category, ()):
                if t is None:
                    continue
                for storage in _storages(t):
                    entry = self._entry(storage)
                    if entry is not None and entry.key not in named:
                        self._grow(entry, self._bytes(storage))
                        named[entry.key] = (entry, category)
        for key, entry in list(self._state.items()):
            if key not in named:
                self._move(entry, "activations" if entry.saved else "other")
        for entry, category in named.values():
            self._move(entry, category)
        self._state = {key: entry for key, (entry, _) in named.items()}

    def _queue_refresh(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._refresh)
        return grad

    def _pack(self, t: torch.Tensor):
        entries = [e for s in _storages(t) if (e := self._entry(s)) is not None]
        # A saved op output holding itself would tie it to its own grad_fn in a cycle; a
        # detached alias shares its storage. Leaves are kept as they are, as autograd does,
        # so a strategy that swaps a parameter's .data (DeepSpeed ZeRO-3) still sees it.
        held = t if t.grad_fn is None else t.detach()
        if not entries:
            return held
        by_attention = current_label() == "attention"
        for entry in entries:
            entry.saved += 1
            if by_attention and not entry.attention:
                entry.attention = True
                self.attention += entry.size
            if entry.category == "other":
                self._move(entry, "activations")
        return _Saved(held, entries, self)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, entry: _Entry) -> None:
        entry.saved -= 1
        if entry.saved == 0:
            if entry.attention:
                entry.attention = False
                self.attention -= entry.size
            if entry.category == "activations":
                self._move(entry, "other")

    # ---- the CUDA allocator's own peak -------------------------------------------------
    def _reset_cuda_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _read_cuda_peak(self) -> int | None:
        peak = cuda_peak_bytes(self.device)
        self.cuda_run_peak = _max(self.cuda_run_peak, peak)
        return peak


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
