"""What one pipeline rank holds beside its model states under ``parallelism.pp_size > 1``:
the activations of the micro-batches the schedule keeps in flight on each of its stages,
and the stage outputs torch's stages keep until each micro-batch's backward, both at the
moment their sum is largest in torch's order of the rank's work
(llm.estimate.schedule_steps); torch's receive buffers, kept for the whole run; and the
working set of a stage's forward or backward at that moment."""

from __future__ import annotations

from dataclasses import dataclass

from llm.estimate.activations import F32, ActivationEstimate, Dtypes, outside_by_stage
from llm.estimate.schedule_steps import peak_state
from llm.estimate.single_moments import MLP_GRADS, WHOLE_AGAIN
from llm.models import ModelArgs
from llm.parallel.pipeline import PipelineLayout
from llm.precision import PrecisionPolicy


@dataclass(frozen=True)
class StageShape:
    """One micro-batch's shape: ``batch`` sequences of ``seq`` tokens in ``policy``'s dtypes,
    tensor parallel over ``tp`` ranks (the residual stream sharded too under sequence
    parallel). ``args.vocab_size`` as the run pads it."""

    args: ModelArgs
    batch: int
    seq: int
    policy: PrecisionPolicy
    tp: int = 1
    sequence_parallel: bool = False


LOSS_TERMS = "loss."  # the outside terms of the loss, after the head


def loss_bytes(acts: ActivationEstimate) -> int:
    """One micro-batch's tensors the loss saves (after the head)."""
    return sum(v for k, v in acts.outside.items() if k.startswith(LOSS_TERMS))


def saved_per_stage(
    acts: ActivationEstimate, pipe: PipelineLayout, pp_rank: int
) -> tuple[list[int], list[int]]:
    """Bytes autograd saves for one micro-batch on each stage of rank ``pp_rank`` (``acts``
    is the formula for one micro-batch), in two parts: what the weight gradients need (the
    stage's blocks, the lookups on the first stage, final norm and head on the last) and the
    loss's tensors on the last stage. A split backward frees the loss's at its input-gradient
    half: torch's ``stage_backward_input`` keeps only the graph below the weights'
    intermediates."""
    blocks = pipe.stage_blocks()
    first, last = outside_by_stage(acts.outside)
    loss = loss_bytes(acts)
    weights, losses = [], []
    for stage in pipe.stages_of(pp_rank):
        is_last = stage == pipe.n_stages - 1
        block_bytes = sum(acts.block(i) for i in blocks[stage])
        weights.append(block_bytes + first * (stage == 0) + (last - loss) * is_last)
        losses.append(loss * is_last)
    return weights, losses


def outputs_per_stage(shape: StageShape, pipe: PipelineLayout, pp_rank: int) -> list[int]:
    """Bytes of the output torch's stage keeps from one micro-batch's forward to its
    backward (``fwd_cache``), which autograd does not save: the (b, s, h) residual stream a
    stage sends on (its sequence shard under sequence parallel), the last stage's logits
    (vocab-split under tp)."""
    logits = shape.batch * shape.seq * shape.args.vocab_size // shape.tp * Dtypes.of(shape.policy).c
    last = pipe.n_stages - 1
    return [logits if stage == last else _stream(shape) for stage in pipe.stages_of(pp_rank)]


def _stream(shape: StageShape) -> int:
    """Bytes of one micro-batch's residual stream on a rank: (b, s, h) in the stream dtype,
    its tp rank's share of the sequence under sequence parallel."""
    split = shape.tp if shape.sequence_parallel else 1
    return shape.batch * shape.seq * shape.args.d_model * Dtypes.of(shape.policy).p // split


def receive_buffers(
    shape: StageShape, pipe: PipelineLayout, microbatches: int, pp_rank: int
) -> int:
    """Bytes of the receive buffers torch's stages keep for the whole run: at its first step
    a ``PipelineStage`` makes one per micro-batch for each tensor it receives from another
    rank, the activation a stage after the first takes in and the gradient of the output a
    stage before the last sends on, both the residual stream's shape (a neighbour on the
    same rank, a V-shaped schedule's turn, hands its tensor over instead)."""
    stream = _stream(shape)
    held = 0
    for stage in pipe.stages_of(pp_rank):
        for neighbour in (stage - 1, stage + 1):
            if 0 <= neighbour < pipe.n_stages and neighbour not in pipe.stages_of(pp_rank):
                held += microbatches * stream
    return held


def stage_working(shape: StageShape, acts: ActivationEstimate, recompute: str) -> int:
    """Bytes a pipeline rank whose stages are not the last holds beyond its saved tensors,
    stage outputs and receive buffers at its peak, the larger of two points (measured on
    rehearsed llama-like stages at tp 1 and 2):
    - the forward of the last micro-batch in flight, which has no output yet: the block's
      input and attention residual (unless a norm saved them), w2's output and, under
      tensor parallel, its all-reduce's output and torch's wrapper of it, against the one
      output ``held_at_peak`` counts (not modelled under sequence parallel, whose
      collectives move shards);
    - the first backward's MLP, last block first: the gradients of the MLP's intermediates
      less w2's input, freed by then (the residual stream's gradient is the received
      buffer); or, during w2's backward, the gradient of its input beside w2's new weight
      gradient. A recomputed block is whole again by then."""
    args, dt = shape.args, Dtypes.of(shape.policy)
    tokens = shape.batch * shape.seq
    stream = _stream(shape)
    d_ff = -(-args.d_ff // shape.tp)
    intermediate = tokens * d_ff * dt.c
    after = (MLP_GRADS[args.family] - 1) * intermediate
    during = intermediate + args.d_model * d_ff * dt.p
    backward = max(after, during)
    if recompute in WHOLE_AGAIN:
        backward += sum(acts.layer_none.values()) - sum(acts.layer.values())
    if shape.sequence_parallel:
        return backward
    # The block's input and attention residual are saved tensors where a norm saves the
    # stream itself (LayerNorm; RMSNorm's fp32 input when the stream is fp32).
    unsaved = 0 if args.family == "gpt2" or dt.p == F32 else 2
    forward = (unsaved + (3 if shape.tp > 1 else 1) - 1) * stream
    return max(forward, backward)


def held_at_peak(
    pipe: PipelineLayout,
    microbatches: int,
    pp_rank: int,
    saved: tuple[list[int], list[int]],
    outputs: list[int],
) -> tuple[int, int]:
    """(saved tensors, stage outputs) in bytes on rank ``pp_rank`` when their sum peaks,
    given one micro-batch's of each per stage (``saved`` as ``saved_per_stage`` gives it)."""
    weights, losses = saved
    until_input = [a + b for a, b in zip(losses, outputs, strict=True)]
    state = peak_state(
        pipe.schedule,
        pipe.pp_size,
        microbatches,
        pipe.virtual_stages,
        pp_rank,
        weights,
        until_input,
    )
    return (
        _dot(state.saved, weights) + _dot(state.outputs, losses),
        _dot(state.outputs, outputs),
    )


def _dot(counts: tuple[int, ...], sizes: list[int]) -> int:
    return sum(n * b for n, b in zip(counts, sizes, strict=True))
