"""Where every rank's pieces of every parameter lie, for optimizers whose arithmetic spans a
whole matrix (Adafactor's row and column statistics, Muon's Newton-Schulz), and the three
collectives they build on.

A strategy that shards parameters (our ZeRO: flat ranges of buckets, FSDP: dim-0 rows) hands
its optimizer a ``ShardLayout``: for each parameter, in one order every rank shares, its
whole shape, its group kind, and the flat range ``[start, stop)`` of the flattened parameter
that each rank holds (``(0, 0)``: none). Every rank knows every range, so a collective's
buffer is laid out the same on every rank without a handshake, and a rank that holds no
piece of a matrix still joins (with nothing to add).

The collectives, each counted through ``count(kind, payload)`` in the payload convention of
llm/parallel/comm_counter.py (all-gather: its output; all-reduce: its buffer; all-to-all:
its input):
- ``all_reduce_sum``: sums a buffer over the group (Adafactor's statistics, norms);
- ``gather_whole``: every rank gets whole matrices from everyone's pieces (Muon's ``gather``);
- ``OwnerExchange``: each matrix's pieces go to the one rank that owns it, and the owner's
  result goes back in pieces (Muon's ``owner``), as two all-to-alls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llm.comm.collectives import all_gather


@dataclass(frozen=True)
class ParamLayout:
    shape: tuple[int, ...]
    kind: str  # the param group kind: "matrix", "vector", or Muon's "hidden"
    ranges: tuple[tuple[int, int], ...]  # per rank: flat [start, stop) held, (0, 0) for none

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def numel_held(self, rank: int) -> int:
        """How many of its elements ``rank`` holds."""
        lo, hi = self.ranges[rank]
        return hi - lo


@dataclass
class ShardLayout:
    params: list[ParamLayout]
    index: dict[int, int]  # id(optimizer tensor) -> its parameter's position in ``params``
    rank: int
    group: dist.ProcessGroup | None
    device: torch.device  # the communication device (NCCL takes no CPU tensor)
    count: Callable[[str, torch.Tensor], None] | None = None

    @property
    def world(self) -> int:
        return len(self.params[0].ranges) if self.params else 1

    def parameter_of(self, tensor: torch.Tensor) -> tuple[int, ParamLayout]:
        """(position, layout) of the parameter ``tensor`` (an optimizer tensor) is part of."""
        i = self.index[id(tensor)]
        return i, self.params[i]

    def start(self, tensor: torch.Tensor) -> int:
        """Where ``tensor``'s elements start in its flattened parameter."""
        return self.parameter_of(tensor)[1].ranges[self.rank][0]

    def _counted(self, kind: str, payload: torch.Tensor) -> None:
        if self.count is not None:
            self.count(kind, payload)

    def all_reduce_sum(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` summed over the group, on ``buffer``'s device."""
        moved = buffer.to(self.device)
        self._counted("optim.all_reduce", moved)
        if self.world > 1:
            dist.all_reduce(moved, group=self.group)
        return moved.to(buffer.device)

    def gather_whole(self, wanted: Sequence[int], local: dict[int, torch.Tensor]) -> dict:
        """Whole parameters ``wanted`` (positions), flat, on every rank: ``local[i]`` is this
        rank's piece of parameter i (flat, its range's length). One all-gather of every
        rank's pieces, each rank's send padded to the longest."""
        lengths = [sum(self.params[i].numel_held(r) for i in wanted) for r in range(self.world)]
        width = max(lengths, default=0)
        dtype = next((t.dtype for t in local.values()), torch.float32)
        send = torch.zeros(width, dtype=dtype, device=self.device)
        pos = 0
        for i in wanted:
            n = self.params[i].numel_held(self.rank)
            if n:
                send[pos : pos + n] = local[i].reshape(-1)
                pos += n
        out = torch.empty(width * self.world, dtype=dtype, device=self.device)
        self._counted("optim.all_gather", out)
        if self.world > 1:
            all_gather(out, send, group=self.group)
        else:
            out.copy_(send)
        whole = {
            i: torch.empty(self.params[i].numel, dtype=dtype, device=self.device) for i in wanted
        }
        for r in range(self.world):
            pos = r * width
            for i in wanted:
                lo, hi = self.params[i].ranges[r]
                if hi > lo:
                    whole[i][lo:hi] = out[pos : pos + hi - lo]
                    pos += hi - lo
        return whole


class OwnerExchange:
    """Whole matrices to their owners and results back, for the parameters ``wanted``:
    ``owners[i]`` is the rank that computes parameter i."""

    def __init__(self, layout: ShardLayout, wanted: Sequence[int], owners: dict[int, int]):
        self.layout, self.wanted, self.owners = layout, list(wanted), owners
        ranks = range(layout.world)
        spans = lambda i, r: layout.params[i].numel_held(r)  # noqa: E731
        me = layout.rank
        # What this rank sends to each rank: its pieces of the matrices that rank owns.
        self.send_sizes = [sum(spans(i, me) for i in self.wanted if owners[i] == d) for d in ranks]
        # What it receives from each rank: their pieces of the matrices this rank owns.
        self.recv_sizes = [sum(spans(i, s) for i in self.wanted if owners[i] == me) for s in ranks]
        self.mine = [i for i in self.wanted if owners[i] == me]

    def to_owners(self, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This rank's whole (flat) matrices, from every rank's pieces ``local``."""
        layout, me = self.layout, self.layout.rank
        dtype = next((t.dtype for t in local.values()), torch.float32)
        send = torch.cat(
            [
                local[i].reshape(-1).to(layout.device)
                for d in range(layout.world)
                for i in self.wanted
                if self.owners[i] == d and layout.params[i].numel_held(me)
            ]
            or [torch.zeros(0, dtype=dtype, device=layout.device)]
        )
        received = self._all_to_all(send, self.send_sizes, self.recv_sizes, dtype)
        whole = {
            i: torch.empty(layout.params[i].numel, dtype=dtype, device=layout.device)
            for i in self.mine
        }
        pos = 0
        for s in range(layout.world):
            for i in self.mine:
                lo, hi = layout.params[i].ranges[s]
                if hi > lo:
                    whole[i][lo:hi] = received[pos : pos + hi - lo]
                    pos += hi - lo
        return whole

    def from_owners(self, results: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This rank's pieces of every matrix, from the owners' whole ``results``."""
        layout, me = self.layout, self.layout.rank
        dtype = next((t.dtype for t in results.values()), torch.float32)
        send = torch.cat(
            [
                results[i][slice(*layout.params[i].ranges[s])].to(layout.device)
                for s in range(layout.world)
                for i in self.mine
                if layout.params[i].numel_held(s)
            ]
            or [torch.zeros(0, dtype=dtype, device=layout.device)]
        )
        received = self._all_to_all(send, self.recv_sizes, self.send_sizes, dtype)
        pieces, pos = {}, 0
        for d in range(layout.world):
            for i in self.wanted:
                n = layout.params[i].numel_held(me)
                if self.owners[i] == d and n:
                    pieces[i] = received[pos : pos + n]
                    pos += n
        return pieces

    def _all_to_all(self, send, send_sizes, recv_sizes, dtype) -> torch.Tensor:
        layout = self.layout
        out = torch.empty(sum(recv_sizes), dtype=dtype, device=layout.device)
        layout._counted("optim.all_to_all", send)
        if layout.world > 1:
            dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=layout.group)
        else:
            out.copy_(send)
        return out


def balanced_owners(costs: dict[int, float], world: int) -> dict[int, int]:
    """Each parameter to a rank, the largest cost first to the least loaded rank (LPT), ties
    to the lower rank: the same answer on every rank."""
    load = [0.0] * world
    owners = {}
    for i in sorted(costs, key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners
