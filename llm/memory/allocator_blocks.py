"""The CUDA allocator's own record of a tracked step (``train.allocator_blocks=N``): every
block the step allocated and freed, with the Python line that asked for it
(``torch.cuda.memory._record_memory_history``), replayed to the moment the allocator's
allocated bytes were highest; the N largest blocks live then. It names what the peak
tracker cannot see, because no tensor holds it: cuBLAS's and cuDNN's workspaces, a
library's buffers. Blocks allocated before the step (weights, optimizer states) are not in
the record; their frees during the step are, and count, so the replay's moment is the
step's true peak.

torch's trace actions: ``alloc`` adds a block's bytes to the allocated total and
``free_completed`` takes them away (``free_requested`` only marks a block whose stream use
is still pending; the segment actions are reserved memory, not allocated)."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Trace entries kept: a tracked step of a large model allocates tens of thousands of blocks.
MAX_ENTRIES = 1_000_000


def blocks_at_peak(trace: list[dict], n: int) -> list[dict]:
    """The ``n`` largest blocks live when the trace's running allocated total was highest,
    largest first: {bytes, made_by (the innermost frame in llm/, else the innermost),
    stream}."""
    total, peak, peak_at = 0, 0, -1
    sizes: dict[int, int] = {}
    for i, entry in enumerate(trace):
        if entry["action"] == "alloc":
            sizes[entry["addr"]] = entry["size"]
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, i
        elif entry["action"] == "free_completed":
            total -= sizes.pop(entry["addr"], entry["size"])
    live: dict[int, dict] = {}
    for entry in trace[: peak_at + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
        elif entry["action"] == "free_completed":
            live.pop(entry["addr"], None)
    largest = heapq.nlargest(n, live.values(), key=lambda e: e["size"])
    return [
        {"bytes": e["size"], "made_by": made_by(e.get("frames", [])), "stream": e.get("stream")}
        for e in largest
    ]


def made_by(frames: list[dict]) -> str:
    """``file:line in function`` of the innermost frame in llm/, else of the innermost."""
    if not frames:
        return "no frame recorded"
    ours = [f for f in frames if "/llm/" in f["filename"]]
    frame = (ours or frames)[0]
    name = frame["filename"]
    short = name[name.rindex("/llm/") + 1 :] if "/llm/" in name else name
    return f"{short}:{frame['line']} in {frame['name']}"


@contextmanager
def recording(device: torch.device, n: int) -> Iterator[list[dict]]:
    """Record the allocator's history on ``device`` inside the block; the list it yields
    holds the ``n`` largest blocks at the block's peak once it exits (nothing with n 0)."""
    found: list[dict] = []
    if n <= 0:
        yield found
        return
    memory = torch.cuda.memory
    memory._record_memory_history(
        context="alloc", stacks="python", max_entries=MAX_ENTRIES, device=device
    )
    try:
        yield found
    finally:
        snapshot = memory._snapshot(device)
        memory._record_memory_history(enabled=None, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        found.extend(blocks_at_peak(snapshot["device_traces"][index], n))
