"""A rank's flat range of a parameter cut into the rectangles a ShardedTensor describes."""

from __future__ import annotations

import math

import pytest
import torch

from llm.parallel.flat_shards import blocks


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
