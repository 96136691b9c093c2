"""What one pipeline rank holds beside its model states under ``parallelism.pp_size > 1``:
the activations of the micro-batches the schedule keeps in flight on each of its stages
(llm/estimate/layout.py's counts, the activation formula for the stage's own blocks and
ends), and the stage outputs torch's stages keep until each micro-batch's backward."""

from __future__ import annotations

from llm.estimate.activations import ActivationEstimate, Dtypes, outside_by_stage
from llm.estimate.layout import stage_in_flight
from llm.models import ModelArgs
from llm.parallel.pipeline import PipelineLayout
from llm.precision import PrecisionPolicy


def stage_activations(
    acts: ActivationEstimate, pipe: PipelineLayout, microbatches: int, pp_rank: int
) -> int:
    """Bytes autograd holds on pipeline rank ``pp_rank`` at its peak: per stage of the rank,
    the micro-batches in flight there times one micro-batch's terms of the stage's blocks
    (``acts`` is the formula for one micro-batch), the lookups on the first stage, final
    norm, head and loss on the last."""
    blocks = pipe.stage_blocks()
    first, last = outside_by_stage(acts.outside)
    counts = stage_in_flight(
        pipe.schedule, pipe.pp_size, microbatches, pipe.virtual_stages, pp_rank
    )
    total = 0
    for stage, n in zip(pipe.stages_of(pp_rank), counts, strict=True):
        per = sum(acts.block(i) for i in blocks[stage])
        total += n * (per + first * (stage == 0) + last * (stage == pipe.n_stages - 1))
    return total


def stage_outputs(
    args: ModelArgs,
    batch: int,
    seq: int,
    policy: PrecisionPolicy,
    pipe: PipelineLayout,
    microbatches: int,
    pp_rank: int,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Bytes of the outputs torch's stages keep from each micro-batch's forward to its
    backward (``fwd_cache``), which autograd does not save: the (b, s, h) residual stream a
    stage sends on (its sequence shard under sequence parallel), the last stage's logits
    (vocab-split under tp). ``batch``: sequences per micro-batch; ``args.vocab_size`` as the
    run pads it."""
    dt = Dtypes.of(policy)
    stream = batch * seq * args.d_model * dt.p // (tp if sequence_parallel else 1)
    logits = batch * seq * args.vocab_size // tp * dt.c
    counts = stage_in_flight(
        pipe.schedule, pipe.pp_size, microbatches, pipe.virtual_stages, pp_rank
    )
    last = pipe.n_stages - 1
    return sum(
        n * (logits if stage == last else stream)
        for stage, n in zip(pipe.stages_of(pp_rank), counts, strict=True)
    )
