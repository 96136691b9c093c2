"""Gradient reduce-scatter during backward, in a fixed order and with a bounded number of
full-size buckets alive.

Order: every rank launches the same collectives in the same order whatever its data did
(a parameter unused in forward on one rank only must not reorder them, or the ranks would
pair different buckets and hang or mix gradients). As DDP does, buckets are launched in a
fixed order, the order gradients are expected to arrive in (blocks from last to first, the
root last): bucket i is launched when it is complete and every bucket before it in that
order has been launched. What is still unlaunched at the end of backward (buckets with an
unused parameter, and those behind them) is launched then, in order.

Memory: at most ``in_flight`` reduce-scatters are launched and not yet waited for; launching
one more first waits for the oldest, adds its slice to the rank's gradient shard and frees
its full-size buffer (stages 2-3: the gradient bucket itself; stage 1: the reduce-dtype copy).
So beyond the shard a rank holds the in-flight buckets plus the ones still being filled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from llm.comm.collectives import reduce_scatter
from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.layout import Slot


class GradientReducer:
    def __init__(
        self,
        order: list[BucketBuffers],
        stage: int,
        group: dist.ProcessGroup | None,
        world: int,
        in_flight: int,
        count: Callable[[str, torch.Tensor], None],
    ) -> None:
        self.order = order  # trainable buckets, in launch order
        self.stage = stage
        self.group = group
        self.world = world
        self.limit = max(1, in_flight)
        self.count = count
        self.next = 0  # position in ``order`` of the next bucket to launch
        self.pending: deque = deque()  # (buffers, input, output, work), oldest first

    def on_grad(self, buf: BucketBuffers, slot: Slot, grad: torch.Tensor) -> None:
        """A parameter's gradient ``grad`` (its local block under tensor parallel) was
        accumulated (autograd's post-accumulate hook)."""
        if self.stage >= 2:
            buf.take_grad(slot, grad, self.world)
        buf.arrived += 1
        while self.next < len(self.order) and self.order[self.next].complete:
            self._launch(self.order[self.next])

    def finish(self) -> None:
        """End of backward: launch what is left in order, then wait for everything."""
        while self.next < len(self.order):
            self._launch(self.order[self.next])
        while self.pending:
            self._retire()
        self.reset()

    def reset(self) -> None:
        self.next = 0
        for buf in self.order:
            buf.arrived = 0

    def _launch(self, buf: BucketBuffers) -> None:
        while len(self.pending) >= self.limit:
            self._retire()
        payload = buf.reduce_input(self.world)
        out = payload.new_empty(buf.bucket.shard)
        work = reduce_scatter(out, payload, group=self.group, async_op=True)
        self.count("reduce_scatter", payload)
        self.pending.append((buf, payload, out, work))
        self.next += 1

    def _retire(self) -> None:
        buf, _, out, work = self.pending.popleft()  # the popped payload is freed here
        work.wait()
        buf.reduced(out)
