"""Gradient reduction of the expert parameters: over the edp ranks that hold the same
experts, not the whole data-parallel group, in buckets launched during backward.

Order (docs/parallel.md, "Collective order under expert parallelism"): every rank launches
the same buckets in the same order whatever its data did. Buckets are laid out once, in the
order gradients arrive (last MoE layer first); bucket i is launched from autograd's
post-accumulate hook when all its gradients exist and every bucket before it was launched,
and what is left at the end of backward is launched then, in order. So the edp collectives
sit at fixed places of the backward graph, which is the same on every rank, as the ep
all-to-alls and the strategy's dp hooks do.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from llm.parallel.experts.shards import ExpertShards


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    arrived: int = 0
    flat: Tensor | None = None  # the reduce payload while in flight
    sizes: list[int] = field(default_factory=list)


class ExpertGradReducer:
    """Buckets of at most ``bucket_cap_mb`` of expert gradients (the strategy's own bucket
    size), each divided by the dp size (as every other gradient is averaged) and all-reduced
    over the edp group asynchronously; :meth:`finish` waits for them and writes the sums
    back into each ``.grad`` before the optimizer step. Hooks act only inside a micro-batch
    that syncs (:meth:`arm`); without one the gradients just accumulate."""

    def __init__(
        self, shards: ExpertShards, bucket_cap_mb: float, counting: Callable[[], bool]
    ) -> None:
        self.shards = shards
        self.counting = counting
        self.buckets = _layout(
            [p for p in shards.params.values() if p.requires_grad], bucket_cap_mb * 2**20
        )
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed = False
        self.next = 0  # index in ``buckets`` of the next one to launch
        self.pending: deque[tuple[_Bucket, object]] = deque()
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, sync: bool) -> None:
        """Before a micro-batch's backward: reduce in it (``sync``) or only accumulate."""
        self.armed = sync

    def _on_grad(self, param: Tensor) -> None:
        if not self.armed:
            return
        self._bucket_of[id(param)].arrived += 1
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if bucket.arrived < len(bucket.params):
                break
            self._launch(bucket)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        grads = [_grad_of(p) for p in bucket.params]
        bucket.sizes = [g.numel() for g in grads]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.shards.dp_size)
        work = None
        if self.shards.edp > 1:
            work = dist.all_reduce(bucket.flat, group=self.shards.edp_group, async_op=True)
            if self.counting():
                self.shards.sent.add("all_reduce", bucket.flat)
        self.pending.append((bucket, work))
        self.next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """End of the syncing backward: launch what is left in order, wait for everything,
        and put each reduced gradient in its parameter's ``.grad``."""
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
        while self.pending:
            bucket, work = self.pending.popleft()
            if work is not None:
                work.wait()
            for param, part in zip(bucket.params, bucket.flat.split(bucket.sizes), strict=True):
                if param.grad is None:
                    param.grad = part.view_as(param).clone()
                else:
                    param.grad.copy_(part.view_as(param))
            bucket.flat = None
        self.reset()

    @contextlib.contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Around a micro-batch's forward and backward: armed when it syncs, finished after
        its backward; a failing backward launches nothing more."""
        self.arm(sync)
        try:
            yield
        except BaseException:
            self.reset()
            raise
        if sync:
            self.finish()

    def reset(self) -> None:
        """Forget a backward's progress (after :meth:`finish`, or when a step fails)."""
        self.armed = False
        self.next = 0
        self.pending.clear()
        for bucket in self.buckets:
            bucket.arrived = 0
            bucket.flat = None


def _grad_of(param: Tensor) -> Tensor:
    """A parameter's gradient, zeros where autograd gave none (every rank sends the bucket)."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _layout(params: list[nn.Parameter], cap_bytes: float) -> list[_Bucket]:
    """Consecutive buckets of at most ``cap_bytes`` (at least one parameter each, one dtype
    each), over ``params`` reversed: gradients arrive from the last layer to the first."""
    buckets: list[_Bucket] = []
    size = 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > cap_bytes or last.params[0].dtype != param.dtype:
            buckets.append(_Bucket([param]))
            size = nbytes
        else:
            last.params.append(param)
            size += nbytes
    return buckets
