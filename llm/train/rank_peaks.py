"""Every rank's step peaks as numbers, so they travel in the logged step's one all-reduce.

A rank writes its peak (the tracker's ``last_step``: bytes per category, the total, the
phase) and its CUDA allocator peak into its own row of a (world, FIELDS) matrix of zeros;
summed over ranks (the all-reduce the Trainer makes anyway for the losses), the matrix holds
every rank's row on every rank. This replaces an object gather (pickling, and under NCCL a
host-device round trip) on every logged step. float64 holds byte counts exactly below 2^53.
"""

from __future__ import annotations

import torch

from llm.memory.peak import CATEGORIES, LABELLED, MOST
from llm.parallel.dist import global_rank, rehearsing

# The phases of a training step (llm/train/trainer.py names them): a peak's phase travels
# as its index here.
STEP_PHASES = ("forward", "backward", "forward_backward", "optimizer_step")
PEAK_KEYS = (*CATEGORIES, "total", LABELLED, *MOST.values())
# [has a peak, PEAK_KEYS..., phase index, has a CUDA peak, CUDA peak]
FIELDS = len(PEAK_KEYS) + 4


def own_rows(
    peak: dict | None, cuda_peak: int | None, rank: int, world: int, device: torch.device
) -> torch.Tensor:
    """A (world * FIELDS,) float64 tensor on ``device``: zeros but for this rank's row."""
    row = [0.0] * FIELDS
    if peak is not None:
        if peak["phase"] not in STEP_PHASES:
            raise ValueError(
                f"peak phase {peak['phase']!r} is not in rank_peaks.STEP_PHASES; add it there"
            )
        row[0] = 1.0
        row[1 : 1 + len(PEAK_KEYS)] = [float(peak[key]) for key in PEAK_KEYS]
        row[1 + len(PEAK_KEYS)] = float(STEP_PHASES.index(peak["phase"]))
    if cuda_peak is not None:
        row[-2:] = [1.0, float(cuda_peak)]
    rows = torch.zeros(world, FIELDS, dtype=torch.float64)
    rows[rank] = torch.tensor(row, dtype=torch.float64)
    return rows.flatten().to(device)


def read_rows(summed: list[float], world: int) -> list[tuple[dict | None, int | None]]:
    """(peak, CUDA peak) per rank from the summed rows, as ``own_rows`` took them. In a
    rehearsal every rank is taken to hold this rank's row, as ``gather_object`` takes its
    value: the fake group's all-reduce adds nothing from other ranks, whose rows stay
    zeros (no peak), and on CUDA the step's ``max`` of the allocator peaks met None."""
    if rehearsing():
        rank = global_rank()
        own = summed[rank * FIELDS : (rank + 1) * FIELDS]
        summed = own * world
    out = []
    for rank in range(world):
        row = summed[rank * FIELDS : (rank + 1) * FIELDS]
        peak = None
        if row[0]:
            peak = {key: int(value) for key, value in zip(PEAK_KEYS, row[1:], strict=False)}
            peak["phase"] = STEP_PHASES[int(row[1 + len(PEAK_KEYS)])]
        out.append((peak, int(row[-1]) if row[-2] else None))
    return out
