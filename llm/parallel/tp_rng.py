"""Dropout masks under tensor parallel: the shared stream, and one per tp rank.

Every rank seeds torch's default generators alike (llm.run), so without more every tp rank
draws the same masks. That is right where the activation is replicated over tp (the residual
stream without sequence parallel: the replicas must drop the same elements or they diverge),
and wrong where each tp rank holds different elements: its attention heads, and under
sequence parallel its sequence shard (embedding and residual dropouts): one mask pattern
repeated on every rank. Those regions run inside ``RankStream.fork()`` (Megatron's
``get_cuda_rng_tracker().fork()``), on generator states of this tp rank's own.
Under torch.compile each forked region (one dropout, or the attention core) runs eagerly
between two graphs: Dynamo cannot trace generator states being swapped.

The rank state is derived, not kept: ``fork`` draws one number from the shared CPU generator
(equal on every tp rank, so the shared stream stays in step across them), seeds the default
CPU and accelerator generators with (draw, tp rank), and gives the shared states back on
exit. So the rank masks are a function of the shared stream's state, which torch already
saves where it matters: torch.utils.checkpoint restores it before a recomputation (full,
selective and op_sac recompute replay the same masks), and the checkpoint's per-rank RNG
files resume it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

# The CPU generator (MT19937) uses a seed's low 32 bits: draw * tp + tp_rank stays below
# 2**32, so the tp ranks' seeds of one draw always differ.
_SEED_BITS = 32


class RankStream:
    """Generator states of one tp rank, derived afresh for each forked region."""

    def __init__(self, tp_rank: int, tp_size: int, device_type: str) -> None:
        self.tp_rank, self.tp_size, self.device_type = tp_rank, tp_size, device_type

    def _generators(self) -> list[torch.Generator]:
        generators = [torch.default_generator]
        if self.device_type != "cpu":  # the accelerator's masks come from its own generator
            module = torch.get_device_module(self.device_type)
            generators.append(module.default_generators[module.current_device()])
        return generators

    @contextmanager
    def fork(self) -> Iterator[None]:
        draw = int(torch.randint(2**_SEED_BITS // self.tp_size, ()))  # the shared CPU stream
        generators = self._generators()
        shared = [g.get_state() for g in generators]
        for g in generators:
            g.manual_seed(draw * self.tp_size + self.tp_rank)
        try:
            yield
        finally:
            for g, state in zip(generators, shared, strict=True):
                g.set_state(state)

    @torch.compiler.disable
    def call(self, fn: Callable[..., Tensor], *args: object) -> Tensor:
        """``fn(*args)`` inside ``fork()``; a clean graph break under torch.compile."""
        with self.fork():
            return fn(*args)


class RankDropout(nn.Dropout):
    """nn.Dropout whose masks in training come from this tp rank's stream."""

    def __init__(self, p: float, stream: RankStream) -> None:
        super().__init__(p)
        self.stream = stream

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and self.p > 0):
            return super().forward(x)
        return self.stream.call(super().forward, x)


def use_rank_streams(
    model: nn.Module, blocks: Iterable[nn.Module], stream: RankStream, sequence_parallel: bool
) -> None:
    """Point the dropouts whose activations differ per tp rank at ``stream``: every block's
    attention-probability dropout (local heads), and under sequence parallel the embedding
    and residual dropouts (sequence shards). The others keep the shared stream."""
    for block in blocks:
        block.attention.core_call = stream.call
        if sequence_parallel:
            attention, mlp = block.attention, block.feed_forward
            attention.resid_dropout = RankDropout(attention.resid_dropout.p, stream)
            mlp.dropout = RankDropout(mlp.dropout.p, stream)
    if sequence_parallel and hasattr(model, "dropout"):  # a pipeline part may lack it
        model.dropout = RankDropout(model.dropout.p, stream)
