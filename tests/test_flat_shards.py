"""A rank's flat range of a parameter cut into the rectangles a DCP checkpoint stores as
chunks, and the planners that save and load them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from llm.parallel.flat_shards import (
    FlatShard,
    FlatShardLoadPlanner,
    FlatShardSavePlanner,
    blocks,
    flat_shard,
)


@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 5)])
def test_blocks_tile_a_flat_range_in_order(shape):
    """A rank's flat slice of a parameter becomes rectangles covering exactly that slice."""
    numel = math.prod(shape)
    flat = torch.arange(numel).view(shape)
    for a in range(numel):
        for b in range(a + 1, numel + 1):
            pieces = [
                flat[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
                for off, size in blocks(shape, a, b)
            ]
            assert torch.equal(torch.cat(pieces), torch.arange(a, b)), (a, b)


def _cut(whole: torch.Tensor, bounds: list[int]) -> FlatShard:
    """One FlatShard holding the rectangles of every range [bounds[i], bounds[i+1]) of
    ``whole``'s flat elements, each a view of a flat copy (the ranks' buffers, in one
    process)."""
    pieces = {}
    for a, b in itertools.pairwise(bounds):
        buffer = whole.reshape(-1)[a:b].clone()
        pieces |= flat_shard(whole.shape, a, buffer).pieces
    return FlatShard(whole.shape, pieces)


def _assembled(shard: FlatShard) -> torch.Tensor:
    out = torch.full(shard.shape, float("nan"))
    for offsets, view in shard.pieces.items():
        out[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape, strict=True))] = view
    return out


def test_planners_save_and_reload_flat_shards_cut_another_way(tmp_path):
    """Saved as one set of flat ranges, loaded into another (a different world size's
    cut), into a plain tensor (what any DCP reader gets), and the nested dict keeps its
    FlatShards for the caller after the load."""
    whole = torch.randn(5, 7)
    saved = {"model": {"w": _cut(whole, [0, 3, 16, 35])}, "step": 4}
    dcp.save(saved, checkpoint_id=str(tmp_path), planner=FlatShardSavePlanner())

    target = flat_shard(whole.shape, 0, torch.zeros(35))
    other = _cut(torch.zeros(5, 7), [0, 9, 10, 30, 35])
    state = {"model": {"w": target}, "step": 0}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=FlatShardLoadPlanner())
    assert state["model"]["w"] is target and state["step"] == 4
    assert torch.equal(_assembled(target), whole)
    dcp.load({"model": {"w": other}}, checkpoint_id=str(tmp_path), planner=FlatShardLoadPlanner())
    assert torch.equal(_assembled(other), whole)

    plain = {"model": {"w": torch.zeros(5, 7)}}
    dcp.load(plain, checkpoint_id=str(tmp_path))
    assert torch.equal(plain["model"]["w"], whole)


def test_a_rank_holding_nothing_reads_nothing_and_a_wrong_shape_is_named(tmp_path):
    whole = torch.randn(4, 3)
    dcp.save(
        {"w": _cut(whole, [0, 12])}, checkpoint_id=str(tmp_path), planner=FlatShardSavePlanner()
    )
    empty = {"w": flat_shard(whole.shape, 0, None)}
    dcp.load(empty, checkpoint_id=str(tmp_path), planner=FlatShardLoadPlanner())
    assert empty["w"].pieces == {}
    with pytest.raises(CheckpointException, match=r"Size mismatch .* for w"):
        bad = {"w": flat_shard((3, 4), 0, torch.zeros(12))}
        dcp.load(bad, checkpoint_id=str(tmp_path), planner=FlatShardLoadPlanner())
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: v"):
        missing = {"v": flat_shard(whole.shape, 0, torch.zeros(12))}
        dcp.load(missing, checkpoint_id=str(tmp_path), planner=FlatShardLoadPlanner())
