"""Every rank's step peaks as rows of one summed tensor (llm/train/rank_peaks.py): what the
logged step's all-reduce hands back is each rank's peak exactly, as the tracker made it."""

from __future__ import annotations

import pytest
import torch

from llm.memory.peak import CATEGORIES, LABELLED, MOST
from llm.train.rank_peaks import STEP_PHASES, own_rows, read_rows

CPU = torch.device("cpu")


def _peak(seed: int, phase: str) -> dict:
    """A tracker-shaped peak (llm.memory.peak.PeakTracker.last_step) with byte counts up to
    about 2^40: large models' figures, which float64 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**40, (len(CATEGORIES) + 1 + len(MOST),), generator=g).tolist()
    peak = dict(zip(CATEGORIES, values, strict=False))
    peak["total"] = sum(peak.values())
    peak[LABELLED] = values[len(CATEGORIES)]
    peak.update(zip(MOST.values(), values[len(CATEGORIES) + 1 :], strict=True))
    peak["phase"] = phase
    return peak


def test_summed_rows_give_back_every_ranks_peak():
    world = 3
    given = [(_peak(0, "backward"), 7 * 2**33), (None, None), (_peak(2, "optimizer_step"), None)]
    summed = sum(own_rows(peak, cuda, rank, world, CPU) for rank, (peak, cuda) in enumerate(given))
    assert read_rows(summed.tolist(), world) == given


def test_an_unknown_phase_is_named():
    peak = _peak(0, "forward")
    peak["phase"] = "warmup"
    with pytest.raises(ValueError, match=r"'warmup' is not in rank_peaks\.STEP_PHASES"):
        own_rows(peak, None, 0, 1, CPU)
    assert "forward" in STEP_PHASES


def test_a_rehearsed_rank_stands_for_every_rank(monkeypatch):
    """The fake group's all-reduce hands back this rank's row alone: every rank reads it, so
    the step's figures (on CUDA, the max of the allocator peaks) meet no None."""
    import llm.train.rank_peaks as rank_peaks

    world, rank = 4, 2
    own = (_peak(5, "backward"), 3 * 2**30)
    alone = own_rows(*own, rank, world, CPU).tolist()
    assert read_rows(alone, world)[0] == (None, None)  # outside a rehearsal: no peak there
    monkeypatch.setattr(rank_peaks, "rehearsing", lambda: True)
    monkeypatch.setattr(rank_peaks, "global_rank", lambda: rank)
    assert read_rows(alone, world) == [own] * world
