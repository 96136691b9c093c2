"""A pipeline stage's neighbours in a rehearsal (llm.rehearse), where no other rank answers.

torch's stages agree on their inputs' shapes at the first step: a point-to-point vote, then
the shapes sent as objects from stage to stage. Over the fake process group every receive
leaves its buffer as it was, so the vote reads zero and the objects are garbage. Here a
stage answers for its neighbours instead: the activation between two stages is the residual
stream, (rows of a micro-batch, T, d) in the dtype of the stage's parameters, and the
gradient it receives for its output has its output's shape. Receive buffers are zeroed
before each receive, so a later stage computes on zeros, never on leftover memory (whose
NaN would make the step skip and leave the optimizer's state unmade). Sequence parallel,
whose stages pass a tp rank's share of the sequence, is refused before this is reached
(llm.rehearse.rank)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def input_shape(stage, rows_and_length: tuple[int, int]) -> tuple[torch.Size, torch.dtype]:
    """The residual stream a stage receives: (rows, T, d) in its parameters' dtype."""
    rows, length = rows_and_length
    dtype = next(stage.submod.parameters()).dtype
    return torch.Size((rows, length, stage.submod.d_model)), dtype


def neighbour_meta(stage, src_stage: int, rows_and_length: tuple[int, int]):
    """What ``src_stage`` would send ``stage`` (torch 2.13's ``_recv_meta``): its output's
    metadata when it is the stage before, the gradient of ``stage``'s own output when it is
    the stage after. The private classes are imported here, where only a torch that has
    them calls this."""
    from torch.distributed.pipelining._utils import (
        _StageBackwardMeta,
        _StageForwardMeta,
        _TensorMeta,
    )

    if src_stage < stage.stage_index:
        shape, dtype = input_shape(stage, rows_and_length)
        stride = (shape[1] * shape[2], shape[2], 1)
        return _StageForwardMeta(forward_metas=(_TensorMeta(shape, stride, dtype, True),))
    return _StageBackwardMeta(backward_metas=stage._stage_meta.outputs)


@contextmanager
def answered_shapes(stage, rows_and_length: tuple[int, int]) -> Iterator[None]:
    """torch 2.11's shape inference receives the previous stage's input metadata as an
    object (``dist.recv_object_list``), which the fake group leaves unset: while it runs,
    the receive answers with the residual stream's shape, as a meta tensor."""
    shape, dtype = input_shape(stage, rows_and_length)
    receive = dist.recv_object_list

    def answer(objects, *args, **kwargs):
        objects[0] = (torch.empty(shape, dtype=dtype, device="meta"),)

    dist.recv_object_list = answer
    try:
        yield
    finally:
        dist.recv_object_list = receive


def zeroed(get_recv_ops: Callable[[int], list]) -> Callable[[int], list]:
    """``get_recv_ops`` (a stage's receives of one micro-batch), their buffers zeroed."""

    def receives(chunk: int) -> list:
        ops = get_recv_ops(chunk)
        with torch.no_grad():
            for op in ops:
                op.tensor.zero_()
        return ops

    return receives
