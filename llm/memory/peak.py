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
  checkpoint keeps (the block inputs) counts, plus what selective activation checkpointing
  caches (recompute=op_sac hands those over with ``kept_for_backward``).
- activations_attention: the part of activations saved inside a ``saved_as("attention")``
  block (the attention kernels: llm.attention labels each call), a storage counted there
  if attention saved it at all; not a category of its own, so not added into the total.
- other: everything else registered: communication buckets, temporaries, gathered
  parameters the strategy does not list as state, gradients of activations.
- params_max, grads_max, optimizer_states_max, activations_max, other_max: the most bytes of
  that category live at any moment of the phase (of the step, in ``last_step``), which need
  not be the moment of the highest total: a pipeline stage's gradients outgrow its in-flight
  activations, and a ZeRO-2 step's highest total can fall in the forward, before any
  gradient exists. State categories are read when the state is classified (at phase
  boundaries and the end of backward), so a gradient counts once its backward has made it.
  Not added into the total either.

The bookkeeping of live storages (sizes re-read after in-place resizes, CUDA block
rounding, saved-tensor hooks) is ``llm.memory.live.LiveStorages``; this module opens and
closes the windows and phases and keeps the peaks.

Not seen: storages that no op wrote or autograd saved while a window was open (model buffers
only read, an input batch copied before the step), memory outside tensors (cuBLAS
workspaces, NCCL buffers, allocator fragmentation), host tensors of a GPU run (offloaded
optimizer states). The backward's ops run in autograd's device threads on CUDA; autograd
carries the dispatch mode into them, so they are seen. On CUDA, ``blocks`` (train.
allocator_blocks) adds the allocator's own record of each tracked step, which sees memory
outside tensors too (llm.memory.allocator_blocks).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

from llm.memory.activations import saving_to
from llm.memory.allocator_blocks import recording
from llm.memory.live import CATEGORIES, STATE, LiveStorages, OpOutputs
from llm.memory.process import cuda_peak_bytes, reset_cuda_peak

# train.memory_tracking: which steps are tracked is llm.train.probes' schedule; off tracks none.
MODES = ("logged", "alternate", "off")
LABELLED = "activations_attention"  # the peak's key for the part attention saved
MOST = {c: f"{c}_max" for c in CATEGORIES}  # the peak's keys for each category's most bytes
__all__ = ["CATEGORIES", "MODES", "PeakTracker"]

StateFn = Callable[[], dict[str, list[torch.Tensor]]]


class PeakTracker:
    """Per-rank peaks of live tensor bytes: of each tracked step (``last_step``), of every
    phase over the run (``by_phase``), and the tracked step with the highest total
    (``best_step``). Each peak is {params, grads, optimizer_states, activations, other,
    total, phase}. On CUDA the allocator's own peak is read beside it (``last_cuda_peak``,
    reset at each step start)."""

    def __init__(
        self, device: torch.device, mode: str = "logged", tensors: int = 0, blocks: int = 0
    ) -> None:
        self.device = torch.device(device)
        self.mode = mode
        self.tensors = tensors  # how many of the largest live tensors each peak lists
        # CUDA: how many of the allocator's largest blocks at each tracked step's peak
        # (llm.memory.allocator_blocks); best_step_blocks: those of best_step.
        self.blocks = blocks if self.device.type == "cuda" else 0
        self.best_step_blocks: list[dict] | None = None
        self._state_fn: StateFn | None = None
        self.live = LiveStorages(self.device, on_high=self._record)
        if tensors:
            self.live.origins = {}
        self._phase: str | None = None
        self._peak: tuple = ()
        self._step_peak: dict | None = None
        self._step_most = dict.fromkeys(MOST.values(), 0)  # each category's most, in the step
        self._mode = OpOutputs(self.live)
        self._open: ExitStack | None = None
        self.last_step: dict | None = None
        self.best_step: dict | None = None
        # With ``tensors``: the largest tensors at best_step's peak (bytes, category, where
        # made), largest first; at the peak of the step being tracked while it runs.
        self.best_step_tensors: list[dict] | None = None
        self._step_tensors: list[dict] | None = None
        self.by_phase: dict[str, dict] = {}
        self.last_cuda_peak: int | None = None
        self.cuda_step_peak: int | None = None  # the highest per-step allocator peak
        self.cuda_run_peak: int | None = None  # over steps, start-up and checkpoints

    @property
    def totals(self) -> dict[str, int]:
        """Live bytes per category now."""
        return self.live.totals

    @property
    def current(self) -> int:
        """Live bytes now."""
        return self.live.current

    # ---- what the caller drives --------------------------------------------------------
    def watch(self, state_fn: StateFn) -> None:
        """Where params, grads and optimizer states come from (a strategy's state_tensors)."""
        self._state_fn = state_fn

    @contextmanager
    def step(self, tracked: bool) -> Iterator[None]:
        """One training step, tracked when ``tracked`` (never under mode off); its phases are
        named with ``phase()``, starting at forward."""
        reset_cuda_peak(self.device)
        self.last_step = None
        if tracked and self.mode != "off":
            with recording(self.device, self.blocks) as blocks, self._window("forward"):
                yield
            self.last_step = {**self._step_peak, **self._step_most}
            if self.best_step is None or self.last_step["total"] > self.best_step["total"]:
                self.best_step = self.last_step
                self.best_step_tensors = self._step_tensors
                self.best_step_blocks = blocks or None
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
        reset_cuda_peak(self.device)
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
        self._step_most = dict.fromkeys(MOST.values(), 0)
        self.live.wrap_resize()
        try:
            self.live.remeasure()
            self._open_phase(phase)
            with self._mode, saving_to(self.live):
                yield
        finally:
            self.live.unwrap_resize()
            if self._phase is not None:
                self._close_phase()

    def _open_phase(self, name: str) -> None:
        self._phase = name
        self._refresh()
        self.live.high = dict(self.live.totals)
        self._record()

    def _close_phase(self) -> None:
        self._refresh()
        peak = self._finish()
        self._phase = None
        self.live.threshold = math.inf  # no new highs recorded between phases
        self._step_most = {k: max(v, peak[k]) for k, v in self._step_most.items()}
        if self._step_peak is None or peak["total"] > self._step_peak["total"]:
            self._step_peak = peak
            self._step_tensors = self._peak_tensors()
        best = self.by_phase.get(peak["phase"])
        if best is None or peak["total"] > best["total"]:
            self.by_phase[peak["phase"]] = peak

    def _record(self) -> None:
        self.live.threshold = self.live.current
        # A copy first (one C call): a collection during the loop runs the weakref callbacks
        # of freed storages, which take their entries out of ``other`` ("dictionary changed
        # size during iteration", seen under 4 gloo ranks).
        others = [(e, e.size) for e in self.live.other.copy().values()]
        largest = None
        if self.tensors:
            entries = self.live.live.copy().values()
            made = self.live.origins
            largest = [
                (e, e.size, e.category, made.get(e.key, "before tracking"))
                for e in heapq.nlargest(self.tensors, entries, key=_size)
            ]
        self._peak = (dict(self.live.totals), others, self._phase, self.live.attention, largest)

    def _finish(self) -> dict:
        """The phase's peak, with storages that were unclassified at the peak and have since
        turned out to be state (gradients made during backward) moved to their category."""
        totals, others, phase, attention, _ = self._peak
        for entry, size in others:
            if entry.category in STATE:
                totals["other"] -= size
                totals[entry.category] += size
        return {
            **totals,
            "total": sum(totals.values()),
            "phase": phase,
            LABELLED: attention,
            **{MOST[c]: self.live.high[c] for c in CATEGORIES},
        }

    def _peak_tensors(self) -> list[dict] | None:
        """The largest tensors at the peak just closed, each in its category there, or in
        the state category it has turned out to be (a gradient made during backward), as
        ``_finish`` counts them."""
        largest = self._peak[4]
        if largest is None:
            return None
        return [
            {
                "bytes": size,
                "category": e.category if then == "other" and e.category in STATE else then,
                "made_by": where,
            }
            for e, size, then, where in largest
        ]

    # ---- state ---------------------------------------------------------------------
    def _refresh(self) -> None:
        """Classify the storages the strategy names as state now."""
        self.live.classify(self._state_fn() if self._state_fn is not None else {})

    def _queue_refresh(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._refresh)
        return grad

    # ---- the CUDA allocator's own peak -------------------------------------------------
    def _read_cuda_peak(self) -> int | None:
        peak = cuda_peak_bytes(self.device)
        self.cuda_run_peak = _max(self.cuda_run_peak, peak)
        return peak


def _size(entry) -> int:
    return entry.size


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
