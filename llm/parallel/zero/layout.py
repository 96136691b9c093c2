"""Where every parameter lives in our ZeRO: flat buckets, each split evenly over the
data-parallel ranks.

Parameters are packed in model order into buckets of about ``bucket_numel`` elements (a
parameter never straddles two buckets; under stage 3 a bucket never straddles two gather
units, so one transformer block is gathered as a whole; frozen and trainable parameters never
share a bucket, so a frozen bucket holds no gradient, master copy or optimizer state). Each bucket is padded to a
multiple of the world size N and rank r owns elements [r*S, (r+1)*S) of it, S = padded/N.
One reduce-scatter per bucket then leaves every rank exactly its own slice of the summed
gradient, and one all-gather per bucket rebuilds the parameters (Megatron's distributed
optimizer lays buffers out the same way).

A rank's slice cuts through parameters; the pieces (parameter ∩ slice) are what the
optimizer steps, so element-wise optimizers need no change, and a piece knows which
parameter it came from for norm-based ones.

Under tensor parallel a parameter is a DTensor and a bucket holds its local block (the
rank's rows or columns, or the whole of a tp-replicated one): ``Slot.shape`` is that block's
shape, and the buckets are cut over the data-parallel ranks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llm.models import model_blocks, param_name
from llm.parallel.tensor_parallel import local_tensor

ShapeOf = Callable[[nn.Parameter], torch.Size]


def local_shape(param: nn.Parameter) -> torch.Size:
    """The shape of what this rank holds of ``param``: a DTensor's local block, else all."""
    return local_tensor(param).shape


@dataclass
class Slot:
    """One parameter inside a bucket: elements [offset, offset + numel)."""

    name: str  # as in the model's state_dict (wrapper prefixes removed)
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size  # of the elements in the bucket: the local block under tensor parallel


@dataclass
class Piece:
    """The part of ``slot`` inside this rank's slice: bucket elements [start, stop)."""

    slot: Slot
    start: int
    stop: int

    @property
    def param_range(self) -> tuple[int, int]:
        """The same elements as offsets into the flattened parameter."""
        return self.start - self.slot.offset, self.stop - self.slot.offset


@dataclass
class Bucket:
    index: int
    unit: int  # the gather unit (stage 3): a transformer block, or the root
    trainable: bool = True  # False: every parameter in it is frozen (requires_grad=False)
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0  # before padding
    padded: int = 0
    shard: int = 0  # S: elements each rank owns

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[Piece]:
        lo, hi = self.shard_range(rank)
        out = []
        for slot in self.slots:
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < stop:
                out.append(Piece(slot, start, stop))
        return out


def build_buckets(
    named_params: list[tuple[str, nn.Parameter, int]],
    bucket_numel: int,
    world: int,
    shape_of: ShapeOf = local_shape,
    alone: nn.Parameter | None = None,
    align: int = 1,
    skip: frozenset = frozenset(),
) -> list[Bucket]:
    """Pack ``(name, param, unit)`` in order into buckets; a new bucket starts when the
    current one would pass ``bucket_numel``, the unit changes or ``requires_grad`` does.
    ``shape_of(param)``: what of the parameter this rank buckets. ``alone``: a parameter
    given a bucket of its own (a pipeline's tied embedding copy: both copies then split
    the same way over the dp ranks, and their reduced shards add up element by element).
    ``align``: every parameter starts at a multiple of it in its bucket (zeros between) and
    every rank's slice is a multiple of it long, so each cut falls on a multiple of
    ``align`` elements of every parameter (8-bit AdamW's 256-element quantisation blocks)."""
    buckets: list[Bucket] = []
    for name, param, unit in named_params:
        shape = torch.Size(shape_of(param))
        numel = shape.numel()
        current = buckets[-1] if buckets else None
        if (
            current is None
            or current.unit != unit
            or current.trainable != param.requires_grad
            or (current.numel and _up(current.numel, align) + numel > bucket_numel)
            or param is alone
            or any(slot.param is alone for slot in current.slots)
        ):
            current = Bucket(index=len(buckets), unit=unit, trainable=param.requires_grad)
            buckets.append(current)
        offset = _up(current.numel, align)
        current.slots.append(Slot(param_name(name), param, offset, numel, shape))
        current.numel = offset + numel
    for bucket in buckets:
        bucket.shard = _up(-(-bucket.numel // world), align)
        bucket.padded = bucket.shard * world
    return buckets


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_buckets(
    model: nn.Module,
    stage: int,
    bucket_cap_mb: float,
    working_itemsize: int,
    world: int,
    shape_of: ShapeOf = local_shape,
    alone: nn.Parameter | None = None,
    align: int = 1,
    skip: frozenset = frozenset(),
    only: frozenset | None = None,
) -> list[Bucket]:
    """The buckets of ``model`` (meta or materialised) under ZeRO ``stage`` on ``world``
    data-parallel ranks: the strategy builds its buffers from them and llm.estimate sizes
    them (a plain meta model, with tensor parallel's local shapes as ``shape_of``), so the
    estimate is this layout. Stage 3's gather units are the blocks in order, then the root
    (everything outside ``model.layers``); stages 1-2 keep model order in one unit.
    ``alone``, ``align``: build_buckets'. ``skip``: parameters no bucket holds (expert
    slices, which differ between ranks: llm/parallel/experts/). ``only``: bucket these
    parameters alone (the expert slices, cut over their edp ranks as a second set)."""
    blocks = model_blocks(model)
    root = len(blocks) if stage == 3 else 0
    unit_of = {}
    if stage == 3:
        for i, block in enumerate(blocks):
            for p in block.parameters():
                unit_of[p] = i
    # Frozen parameters are bucketed too (apart from trainable ones): stage 3 shards them,
    # and every stage keeps them in the working dtype.
    named = [
        (n, p, unit_of.get(p, root))
        for n, p in model.named_parameters()
        if (p in only if only is not None else p not in skip)
    ]
    if stage == 3:
        named.sort(key=lambda item: item[2])  # blocks in order, then the root
    bucket_numel = max(1, int(bucket_cap_mb * 2**20 / working_itemsize))
    return build_buckets(named, bucket_numel, world, shape_of, alone, align)
