"""A rank's flat range of a parameter as a ShardedTensor that torch DCP saves and loads in place.

ZeRO (ours and DeepSpeed's) cuts flat buffers without regard to parameter boundaries, so a
rank holds elements [start, start + n) of a flattened parameter. A row-major range is a few
rectangles (a partial first row, whole rows, a partial last row, recursively), which is what
a ShardedTensor's shards can describe. The shards are views of the rank's own buffer: DCP
writes them without a gather, and on load reads only the saved chunks that overlap them
(from any world size or strategy) straight into place.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

# torch 2.13 deprecates ShardedTensor for DTensor, but a DTensor shards evenly and cannot
# describe ZeRO's cuts; DCP still reads and writes ShardedTensors.
warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)


def blocks(shape: tuple[int, ...], a: int, b: int) -> list[tuple[list[int], list[int]]]:
    """Row-major elements [a, b) of a tensor of ``shape`` as (offsets, sizes) rectangles, in
    order, so that consecutive blocks are consecutive slices of the flat range."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [([a], [b - a])]
    row = math.prod(shape[1:])
    inner = shape[1:]
    first, last = a // row, b // row  # rows holding a and b (b exclusive)
    if first == last:  # inside one row
        return [([first, *o], [1, *s]) for o, s in blocks(inner, a % row, b % row)]
    out = []
    if a % row:
        out += [([first, *o], [1, *s]) for o, s in blocks(inner, a % row, row)]
        first += 1
    if last > first:
        out.append(([first] + [0] * len(inner), [last - first, *inner]))
    if b % row:
        out += [([last, *o], [1, *s]) for o, s in blocks(inner, 0, b % row)]
    return out


def sharded(
    shape,
    start: int,
    local: torch.Tensor | None,
    like: torch.Tensor,
    group,
    block: tuple[list[int], list[int]] | None = None,
) -> ShardedTensor:
    """A ShardedTensor of ``shape`` whose local shards are views of ``local``, this rank's
    elements [start, start + local.numel()) of the flattened tensor (a 1-D view into its
    buffer). ``block`` (sizes, offsets): the range counts in that block of the tensor instead
    (tensor parallel's rows or columns of a rank). ``local`` None or empty: this rank holds
    none of it; ``like`` then gives dtype, device and pinning (DCP requires them equal on
    every rank). Collective over ``group``, whose ranks' ranges cover the tensor once (shards
    are placed by global rank, as ShardedTensor requires)."""
    shape = list(shape)
    if local is None or local.numel() == 0:
        # One empty shard, not none: DCP's loader drops a key whose ShardedTensor has no
        # local shard, then takes the checkpoint for an old-format one and refuses it. It
        # sits past the last row: DCP's save dedups chunks by offset, and one at the origin
        # would replace the real shard that starts there.
        sizes = [0, *shape[1:]]
        empty = like.detach().view(-1)[:0].view(sizes)  # a view keeps the buffer's pinning
        place = f"rank:{dist.get_rank()}/{like.device}"
        meta = ShardMetadata([shape[0]] + [0] * (len(shape) - 1), sizes, place)
        return init_from_local_shards([Shard(empty, meta)], *shape, process_group=group)
    data = local.detach().view(-1)
    place = f"rank:{dist.get_rank()}/{data.device}"
    sizes_in, origin = block or (shape, [0] * len(shape))
    shards, pos = [], 0
    for offsets, sizes in blocks(tuple(sizes_in), start, start + data.numel()):
        n = math.prod(sizes)
        offsets = [o + b for o, b in zip(offsets, origin, strict=True)]
        shards.append(
            Shard(data.narrow(0, pos, n).view(sizes), ShardMetadata(offsets, sizes, place))
        )
        pos += n
    return init_from_local_shards(shards, *shape, process_group=group)
