"""The model side of expert parallelism: what a MoE layer's ``exchange`` does with its
tokens (llm/models/moe.py's ``LocalExchange`` is the one-process case).

Per MoE layer and micro-batch (llm/models/moe.py hands over the assignments sorted by
expert, so each destination's rows are one run):
- counts: one all-gather of the (E,) assignment counts over the data-parallel group, so the
  balance loss and the capacity see the global micro-batch, as one process does;
- dispatch: the (ep, E/ep) counts of what each rank sends each expert, exchanged with one
  all_to_all_single, then the rows;
- combine: the expert outputs back the same way. Backward runs each exchange in reverse.

The rows travel one of two ways, by what the experts' kernel needs:
- exact (the loop kernel, which reads its counts on the host anyway): per-rank split sizes
  read on the host once per layer, with the experts' counts; only the rows that leave a
  rank are sent;
- padded (the grouped kernel): a fixed block of ``tokens x min(top_k, E/ep)`` rows per
  destination, the most one rank can send another, zeros after its rows; nothing is read
  on the host. The receiver regroups what arrived by expert on the device, the padding
  last, counted with its last expert: zero rows in, zero rows out, no gradient.

Bytes sent to other ranks are counted (``take_sent``): rows that leave the rank (padding
included), times d_model, times the element size, for dispatch and combine, forward and
backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from llm.comm.sent import CommCounter
from llm.models.moe import Experts


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx, x: Tensor, send: list[int], recv: list[int], group, sent: CommCounter
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.sent = send, recv, group, sent
        return _exchange(x, send, recv, group, sent)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.sent), *[None] * 4


def _exchange(x: Tensor, send: list[int], recv: list[int], group, sent: CommCounter) -> Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x, recv, send, group=group)
    me = dist.get_rank(group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent.add_bytes("all_to_all", (sum(send) - send[me]) * row_bytes)
    return out


class DataParallelExchange:
    """Every expert here, tokens spread over ``group``: counts summed over it, the experts run
    on this rank's rows alone."""

    def __init__(self, group) -> None:
        self.group = group
        self.sent = CommCounter()

    def count(self, counts: Tensor) -> tuple[Tensor, Tensor]:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        every = counts.new_empty(world * counts.numel())
        dist.all_gather_into_tensor(every, counts.contiguous(), group=self.group)
        every = every.view(world, counts.numel())
        self.sent.add("all_gather", counts)
        return every.sum(0), every[:rank].sum(0)

    def run(self, experts: Experts, x: Tensor, counts: Tensor, tokens: int, top_k: int) -> Tensor:
        return experts(x, counts)

    def take_sent(self) -> dict[str, int]:
        return self.sent.take_sent()


class AllToAllExchange(DataParallelExchange):
    """This rank's E / ep experts; the rows of every other expert go to its rank."""

    def __init__(self, dp_group, ep_group, n_experts: int) -> None:
        super().__init__(dp_group)
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.local = n_experts // self.ep

    def run(self, experts: Experts, x: Tensor, counts: Tensor, tokens: int, top_k: int) -> Tensor:
        """x: rows sorted by global expert, ``counts`` (E,) of each, from this rank's
        ``tokens`` with ``top_k`` experts each; returns their outputs."""
        per_rank = counts.view(self.ep, self.local)  # what this rank sends each expert
        received = torch.empty_like(per_rank)  # (source rank, local expert)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.ep_group)
        if experts.reads_counts(x):
            return self._exact(experts, x, per_rank, received)
        # A token's top_k experts are distinct: at most min(top_k, E/ep) of them on a rank.
        block = tokens * min(top_k, self.local)
        return self._padded(experts, x, per_rank, received, block)

    def _exact(self, experts: Experts, x: Tensor, per_rank: Tensor, received: Tensor) -> Tensor:
        # The all-to-all takes its split sizes as host lists: one read per layer for all of
        # them, the experts' row counts with them (the loop kernel needs them).
        on_host = torch.cat([per_rank.sum(1), received.sum(1), received.sum(0)]).tolist()
        send, recv = on_host[: self.ep], on_host[self.ep : 2 * self.ep]
        rows = _AllToAll.apply(x, send, recv, self.ep_group, self.sent)
        # Received runs are (source, expert); the experts want (expert, source).
        order = _regroup(received, sum(recv))
        y = experts(rows[order], received.sum(0), on_host[2 * self.ep :])
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], recv, send, self.ep_group, self.sent)

    def _padded(
        self, experts: Experts, x: Tensor, per_rank: Tensor, received: Tensor, block: int
    ) -> Tensor:
        """Every rank sends every rank ``block`` rows (its own rows first, zeros after):
        split sizes known without reading the counts."""
        to_rank = per_rank.sum(1)
        dest = torch.repeat_interleave(
            torch.arange(self.ep, device=x.device), to_rank, output_size=x.shape[0]
        )
        # Row i (sorted by expert, so by destination) goes to its destination's block, at
        # its place within that destination's run.
        first = torch.cumsum(to_rank, 0) - to_rank
        slots = dest * block + torch.arange(x.shape[0], device=x.device) - first[dest]
        send = x.new_zeros(self.ep * block, *x.shape[1:]).index_copy(0, slots, x)
        split = [block] * self.ep
        rows = _AllToAll.apply(send, split, split, self.ep_group, self.sent)
        place = _padded_places(received, block)
        order = torch.empty_like(place)
        order[place] = torch.arange(place.numel(), device=place.device)
        per_expert = received.sum(0)
        per_expert[-1] += place.numel() - received.sum()  # the padding, zeros, goes last
        y = experts(rows[order], per_expert)
        back = _AllToAll.apply(y[place], split, split, self.ep_group, self.sent)
        return back[slots]


def _regroup(runs: Tensor, total: int) -> Tensor:
    """Row order that turns runs laid out (source, expert) into (expert, source); ``total``
    rows in all (known on the host)."""
    sizes = runs.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = torch.arange(sizes.numel(), device=runs.device).view(runs.shape).t().reshape(-1)
    size, start = sizes[by_expert], starts[by_expert]
    new_start = torch.cumsum(size, 0) - size
    shift = torch.repeat_interleave(start - new_start, size, output_size=total)
    return torch.arange(total, device=runs.device) + shift


def _padded_places(received: Tensor, block: int) -> Tensor:
    """For each row of ``ep`` received blocks of ``block`` rows (source s's block holds
    ``received[s]`` rows per local expert, in expert order, then padding), its place once
    regrouped by (expert, source), the padding after every real row."""
    ep, local = received.shape
    j = torch.arange(block, device=received.device)
    ends = torch.cumsum(received, 1)  # (ep, local): where each expert's run ends in a block
    expert = torch.searchsorted(ends, j.expand(ep, block).contiguous(), right=True)
    real = expert < local
    expert = expert.clamp(max=local - 1)
    starts = ends - received
    within = j - starts.gather(1, expert)  # place in its (source, expert) run
    per_expert = received.sum(0)
    expert_start = torch.cumsum(per_expert, 0) - per_expert
    source_start = torch.cumsum(received, 0) - received  # earlier sources' rows per expert
    place = expert_start[expert] + source_start.gather(1, expert) + within
    valid = ends[:, -1:]  # real rows per source
    pad_start = received.sum() + torch.cumsum(block - valid, 0) - (block - valid)
    return torch.where(real, place, pad_start + j - valid).reshape(-1)
