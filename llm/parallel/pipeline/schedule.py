"""Runs a step's micro-batches through torch.distributed.pipelining's schedules.

The Trainer hands the loader batches of a step, the loss normaliser and its loss and forward
context (``forward_backward``); each loader batch is one ``schedule.step``, which splits it
into ``pp_microbatches`` micro-batches along the batch dimension. The last stage's loss per
micro-batch is the summed cross-entropy times the Trainer's ``scale`` (dp_size / global
target tokens), under the loss scaler, with ``scale_grads=False``: gradients come out
exactly as the Trainer's own loop leaves them, and the loss sum it returns is the unscaled
one (zero on ranks without the last stage).

Data parallel over each stage's dp group: torch's stages hold back FSDP2's (and
``replicate``'s) gradient reduction until a schedule step's last backward themselves; a
strategy that reduces through its own hooks (our ZeRO) passes ``grad_sync``, the context
each micro-batch's backward of a stage runs in, told whether it is the step's last.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from llm.config import PP_V_SHAPED
from llm.parallel.dist import rehearsing
from llm.parallel.mesh import ParallelDims
from llm.parallel.pipeline.modules import PipelinePart
from llm.parallel.pipeline.rehearsal import answered_shapes, neighbour_meta, zeroed
from llm.parallel.pipeline.tied import TiedEmbeddings
from llm.precision import LossScaler

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The context one micro-batch's backward runs in; its argument: the step's last backward.
GradSync = Callable[[bool], AbstractContextManager]
# torch 2.12 and later stages infer DTensor metadata at run time and take the mesh it needs
# from this callback; 2.11's have no such inference and no such argument.
_STAGE_TAKES_MESH = "get_mesh" in inspect.signature(PipelineStage).parameters


class _SyncedStage(PipelineStage):
    """A stage whose every backward runs inside the strategy's ``grad_sync`` context; the
    step's last is the last backward of the step's last loader batch. In a rehearsal
    (llm.rehearse) it answers for its neighbours' shapes itself (``rehearsal``)."""

    def __init__(
        self,
        *args,
        grad_sync: GradSync,
        last_batch: Callable[[], bool],
        chunk: Callable[[], tuple[int, int]],
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._grad_sync = grad_sync
        self._last_batch = last_batch
        self._chunk = chunk
        if rehearsing():
            self.get_fwd_recv_ops = zeroed(self.get_fwd_recv_ops)
            self.get_bwd_recv_ops = zeroed(self.get_bwd_recv_ops)

    def _recv_meta(self, src_stage: int):
        if rehearsing():
            return neighbour_meta(self, src_stage, self._chunk())
        return super()._recv_meta(src_stage)

    def _shape_inference(self, *args, **kwargs):
        """torch 2.11's path (2.13 receives through ``_recv_meta`` instead)."""
        if not rehearsing():
            return super()._shape_inference(*args, **kwargs)
        with answered_shapes(self, self._chunk()):
            return super()._shape_inference(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        with self._grad_sync(last_backward and self._last_batch()):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class Pipeline:
    """This rank's stages and the schedule over them; built once the part is materialised
    (and sharded)."""

    def __init__(
        self,
        part: PipelinePart,
        dims: ParallelDims,
        microbatches: int,
        device: torch.device,
        scaler: LossScaler,
        count_comm: bool = False,
        grad_sync: GradSync | None = None,
    ) -> None:
        self.part = part
        self.dims = dims
        self.microbatches = microbatches
        self.device = device
        self.scaler = scaler
        self.tied = TiedEmbeddings(part, dims)
        group = dims.pp_group()
        n_stages = part.layout.n_stages
        mesh = {"get_mesh": lambda names, _layout: dims.mesh[names]} if _STAGE_TAKES_MESH else {}
        self._last_batch = True  # the batch running now is the step's last
        self._chunk = (0, 0)  # a micro-batch's (rows, length) in the batch running now
        self.stages = [
            _SyncedStage(
                module,
                module.index,
                n_stages,
                device,
                group=group,
                **mesh,
                grad_sync=grad_sync or (lambda _last: nullcontext()),
                last_batch=lambda: self._last_batch,
                chunk=lambda: self._chunk,
            )
            for module in part.stages()
        ]
        self.has_first = any(s.is_first for s in self.stages)
        self._sent: dict[str, int] = {}
        self.counting = count_comm  # then set per step by the strategy's count_comm()
        if count_comm:
            for stage in self.stages:
                stage.get_fwd_send_ops = self._counted(stage.get_fwd_send_ops, "activations")
                stage.get_bwd_send_ops = self._counted(stage.get_bwd_send_ops, "gradients")
        self._loss_fn: LossFn | None = None
        self._scale: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        cls = SCHEDULES[part.layout.schedule]
        first = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(
            first, n_microbatches=microbatches, loss_fn=self._stage_loss, scale_grads=False
        )

    def _stage_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss per micro-batch: summed (the Trainer's loss), kept unscaled
        for the step's loss sum, returned scaled for backward."""
        loss = self._loss_fn(logits, targets)
        self._losses.append(loss.detach())
        if self._scale is None:  # evaluation: no backward
            return loss
        return self.scaler.scale_loss(loss * self._scale)

    def forward_backward(
        self,
        batches: list,
        scale: torch.Tensor,
        loss_fn: LossFn,
        forward_context: Callable[[], AbstractContextManager],
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batches`` (the loader's
        ``(input_ids, targets, doc_ids)``); gradients accumulate over them. Returns this
        rank's summed loss, unscaled: zero unless it holds the last stage."""
        return self._run(batches, loss_fn, forward_context, scale)

    def evaluate(
        self,
        batch,
        loss_fn: LossFn,
        forward_context: Callable[[], AbstractContextManager],
    ) -> torch.Tensor:
        """The summed loss of one batch (zero unless this rank holds the last stage),
        forward only. torch 2.13's ``eval()`` of the V-shaped schedules runs their
        input-gradient actions and fails ("can't steal_bwd_input"): those evaluate with a
        training step whose gradients are dropped (evaluation runs between steps, when
        there are none)."""
        if self.part.layout.schedule not in PP_V_SHAPED:
            return self._run([batch], loss_fn, forward_context, None)
        with torch.enable_grad():
            loss_sum = self._run([batch], loss_fn, forward_context, torch.ones(()))
        for param in self.part.parameters():
            param.grad = None
        return loss_sum

    def _run(self, batches, loss_fn, forward_context, scale) -> torch.Tensor:
        self._loss_fn, self._scale = loss_fn, scale
        self.part.context = forward_context
        run = self.schedule.step if scale is not None else self.schedule.eval
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (input_ids, targets, _) in enumerate(batches):
            self._last_batch = i == len(batches) - 1
            self._chunk = (input_ids.size(0) // self.microbatches, input_ids.size(1))
            # Every rank reads the batch; the first stage takes the ids, the last the targets.
            args = (input_ids,) if self.has_first else ()
            self._losses = []
            run(*args, target=targets, return_outputs=False)
            # The schedule's first call also infers the stages' shapes with one forward and
            # loss (of placeholder activations past the first stage): the micro-batches' own
            # losses are the last ones.
            for loss in self._losses[len(self._losses) - self.microbatches :]:
                loss_sum += loss
        return loss_sum

    def _counted(self, get_ops: Callable, what: str) -> Callable:
        """``get_ops`` (a stage's sends of one micro-batch), adding their bytes to
        ``pp.send_{what}``; sends to a stage on the same rank are not sends."""
        key = f"pp.send_{what}"

        def counted(chunk: int) -> list:
            ops = get_ops(chunk)
            if ops and self.counting:  # the first stage sends no gradients, the last no activations
                sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                self._sent[key] = self._sent.get(key, 0) + sent
            return ops

        return counted

    def take_sent(self) -> dict[str, int]:
        """Bytes this rank sent to other stages since the last call (with count_comm)."""
        sent, self._sent = self._sent, {}
        return sent

    def grad_copies(self, param: torch.Tensor) -> int:
        """On how many pipeline ranks ``param``'s gradient exists (2 for a tied embedding
        split over two stages, else 1): the clipping norm divides by it."""
        return 2 if self.tied.holds(param) else 1

    def sum_tied_grads(self) -> None:
        self.tied.sum_grads()

    def checkpoint_names(self, optim_state: dict, whole: bool) -> dict:
        """The optimizer state of a tied head copy under the embedding's name (``whole``),
        as one process keys the shared parameter, or back to the copy's own name."""
        return self.tied.rename(optim_state, whole)
