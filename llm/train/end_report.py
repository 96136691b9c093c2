"""The end-of-run report: the summary every rank returns from ``Trainer.fit`` (llm.run
adds the run's facts and writes it to summary.json), from the loop's state and the
trainer's instruments."""

from __future__ import annotations

import torch

from llm.memory import PeakTracker, peak_rss_bytes
from llm.train.metrics import perplexity
from llm.train.train_state import TrainState


def run_summary(
    state: TrainState,
    *,
    stopped: bool,
    stop_signal: str | None,
    mfu: dict[str, float | None],
    memory: dict,
    activations: dict,
    model_state_bytes: dict[str, int],
    comm: dict,
    fp8: dict,
) -> dict:
    """``mfu``: MFU of the median tokens/s under each FLOP count; ``memory``:
    :func:`memory_summary`; ``comm``: :func:`comm_summary`; ``fp8``: the fp8 watch's."""
    # Steady-state throughput of the timed steps: after the warm-up steps where any are.
    timed = state.timed
    return {
        "steps": state.step,
        "stopped_early": stopped,
        # This rank's signal (SIGINT, SIGTERM) when one stopped the run; a rank that only
        # heard of the stop through the vote has None.
        "stop_signal": stop_signal,
        "final_train_loss": state.last_loss,
        "final_val_loss": state.last_val_loss,
        "final_val_ppl": (
            perplexity(state.last_val_loss) if state.last_val_loss is not None else None
        ),
        "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps,
        "tokens_per_sec": timed.median_tokens_per_sec(),
        "step_time_s": timed.median_step_time_s(),
        **mfu,
        "data_wait_share": timed.median_data_wait_share(),
        **_timing_counts(state),
        **memory,
        **activations,
        "model_state_bytes": model_state_bytes,
        **comm,
        **fp8,
    }


def memory_summary(tracker: PeakTracker, device: torch.device) -> dict:
    """This rank's peaks over the run; llm.run gathers them from every rank."""
    on_cuda = device.type == "cuda"
    phase_max = max((p["total"] for p in tracker.by_phase.values()), default=None)
    best = tracker.best_step
    return {
        "memory_peak": best,
        "memory_peak_by_phase": tracker.by_phase,
        # train.peak_tensors: numbered from 1, largest first (W&B names dict keys, not items)
        "memory_peak_tensors": None
        if tracker.best_step_tensors is None
        else {str(i): t for i, t in enumerate(tracker.best_step_tensors, 1)},
        # train.allocator_blocks (CUDA): the allocator's largest blocks at best_step's peak
        "memory_allocator_blocks": None
        if tracker.best_step_blocks is None
        else {str(i): b for i, b in enumerate(tracker.best_step_blocks, 1)},
        "peak_memory_bytes": tracker.cuda_step_peak if on_cuda else _total(best),
        "max_peak_memory_bytes": tracker.cuda_run_peak if on_cuda else phase_max,
        "cuda_max_allocated_bytes": tracker.cuda_step_peak,
        "process_peak_rss_bytes": peak_rss_bytes(),
    }


def comm_summary(state: TrainState, count_comm: bool, world_size: int) -> dict:
    """Bytes per collective kind per step; where nothing was counted because counting is
    off (parallelism.count_comm=false) on a run that communicates, None and why, never an
    empty dict that reads as "no communication"."""
    steps = max(state.comm_steps, 1)
    sent = {k: v / steps for k, v in state.comm_per_step.items()}
    if sent or count_comm or world_size == 1:
        return {"comm_bytes_per_step": sent}
    return {
        "comm_bytes_per_step": None,
        "comm_bytes_note": "not counted: parallelism.count_comm=false (counting hooks "
        "distort step time); set it true to count the bytes of each collective",
    }


def _timing_counts(state: TrainState) -> dict:
    """How many steps the timings come from, and why there are none where that is so."""
    timed = len(state.timed.steps)
    out = {"timed_steps": timed, "probe_steps": state.probe_steps}
    if not timed:
        out["tokens_per_sec_note"] = (
            "no timed step: every step ran an instrument (precision.fp8_stats_every=1, "
            "or too few steps); timings come only from steps that run none"
        )
    return out


def _total(peak: dict | None) -> int | None:
    return None if peak is None else peak["total"]
