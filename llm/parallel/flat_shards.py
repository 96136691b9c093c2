"""A rank's flat range of a parameter as chunks that torch DCP saves and loads in place.

ZeRO (ours and DeepSpeed's) cuts flat buffers without regard to parameter boundaries, so a
rank holds elements [start, start + n) of a flattened parameter. A row-major range is a few
rectangles (a partial first row, whole rows, a partial last row, recursively), and a DCP
checkpoint stores any tensor as rectangular chunks. ``FlatShard`` holds a rank's rectangles
as views of its own buffer, and two planners (DCP's default ones plus these leaves) write
one chunk per rectangle without a gather, and on load read only the saved chunks that
overlap them (from any world size or strategy) straight into place.

This replaces torch's ShardedTensor, deprecated for DTensor: a DTensor's shards follow
``torch.chunk`` along a dimension and cannot describe ZeRO's cuts, while DCP's planner
interface (``WriteItem``, ``ReadItem``, chunk metadata) is public and takes any rectangles.
The files are the ones a ShardedTensor wrote: the same chunks under the same keys.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


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


@dataclass(frozen=True)
class FlatShard:
    """This rank's rectangles of a tensor of ``shape``: ``pieces`` maps each rectangle's
    offsets to a view of the rank's buffer shaped like it; empty where the rank holds none
    of the tensor."""

    shape: torch.Size
    pieces: dict[tuple[int, ...], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.pieces.values())

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape)
            for o, t in self.pieces.items()
        ]


def flat_shard(
    shape, start: int, local: torch.Tensor | None, block: tuple[list[int], list[int]] | None = None
) -> FlatShard:
    """The FlatShard of a tensor of ``shape`` whose pieces are views of ``local``, this
    rank's elements [start, start + local.numel()) of the flattened tensor (a 1-D view into
    its buffer). ``block`` (sizes, offsets): the range counts in that block of the tensor
    instead (tensor parallel's rows or columns of a rank). ``local`` None or empty: this rank
    holds none of it. The ranks' ranges must cover the tensor once (tensor-parallel peers
    that hold the same range write it once: DCP dedups equal chunks)."""
    if local is None or local.numel() == 0:
        return FlatShard(torch.Size(shape), {})
    data = local.detach().view(-1)
    sizes_in, origin = block or (list(shape), [0] * len(shape))
    pieces, pos = {}, 0
    for offsets, sizes in blocks(tuple(sizes_in), start, start + data.numel()):
        n = math.prod(sizes)
        at = tuple(o + b for o, b in zip(offsets, origin, strict=True))
        pieces[at] = data.narrow(0, pos, n).view(sizes)
        pos += n
    return FlatShard(torch.Size(shape), pieces)


def _split(state_dict: dict) -> tuple[dict[str, FlatShard], dict]:
    flat = {k: v for k, v in state_dict.items() if isinstance(v, FlatShard)}
    return flat, {k: v for k, v in state_dict.items() if k not in flat}


class FlatShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one write item per rectangle of a FlatShard leaf."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.flat, self.state_dict = _split(self.state_dict)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(at)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(at), sizes=view.shape),
                    properties=TensorProperties.create_from_tensor(view),
                    size=shard.shape,
                ),
            )
            for fqn, shard in self.flat.items()
            for at, view in shard.pieces.items()
        ]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.flat:
            return self.flat[index.fqn].pieces[tuple(index.offset)]
        return super().lookup_object(index)


def _take_flat_shards(tree: dict, path: tuple = ()) -> dict[tuple, FlatShard]:
    """Every FlatShard in the nested dicts of ``tree`` by its key path, each replaced by None
    there (DCP's load set-up replaces objects it does not know by None)."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, FlatShard):
            found[(*path, str(key))] = value
            tree[key] = None
        elif isinstance(value, dict):
            found |= _take_flat_shards(value, (*path, str(key)))
    return found


def _put_back(tree: dict, found: dict[tuple, FlatShard]) -> None:
    for path, shard in found.items():
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = shard


class FlatShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus read items for each rectangle of a FlatShard leaf:
    the parts of the saved chunks that overlap it, copied into its view."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        found = _take_flat_shards(state_dict)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            _put_back(state_dict, found)  # the caller reads them after the load
        by_path = {tuple(path): fqn for fqn, path in self.mappings.items()}
        for path, shard in found.items():
            self.state_dict[by_path.get(path, ".".join(path))] = shard

    def create_local_plan(self) -> LoadPlan:
        flat, rest = _split(self.state_dict)
        strict = not self.allow_partial_load
        plan = create_default_local_load_plan(rest, self.metadata, strict)
        items = []
        for fqn, shard in flat.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            if getattr(md, "size", None) != shard.shape:
                raise ValueError(
                    f"Size mismatch between saved {getattr(md, 'size', md)} and current: "
                    f"{shard.shape} for {fqn}"
                )
            if shard.pieces:
                items += create_read_items_for_chunk_list(fqn, md, shard.chunks())
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, FlatShard):
            return found.pieces[tuple(index.offset)]
        return super().lookup_tensor(index)
