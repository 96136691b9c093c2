"""What one pipeline rank holds beside its model states under ``parallelism.pp_size > 1``:
the activations of the micro-batches the schedule keeps in flight on each of its stages,
and the stage outputs torch's stages keep until each micro-batch's backward, both at the
moment their sum is largest in torch's order of the rank's work
(llm.estimate.schedule_steps)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.estimate.activations import ActivationEstimate, Dtypes, outside_by_stage
from llm.estimate.schedule_steps import peak_state
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
    dt = Dtypes.of(shape.policy)
    tokens = shape.batch * shape.seq
    stream = tokens * shape.args.d_model * dt.p // (shape.tp if shape.sequence_parallel else 1)
    logits = tokens * shape.args.vocab_size // shape.tp * dt.c
    last = pipe.n_stages - 1
    return [logits if stage == last else stream for stage in pipe.stages_of(pp_rank)]


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
