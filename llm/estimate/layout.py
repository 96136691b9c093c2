"""A parallel layout on paper (dp x tp x pp, a ZeRO stage over dp, a pipeline schedule) and
what one of its ranks holds: parameters by pipeline rank and tensor-parallel shard, the
micro-batches a pipeline schedule keeps in flight, the bubble, and the stage-boundary
traffic. Closed forms from the shape alone, and torch's schedules played out action by
action (llm.estimate.schedule_steps), so a 1T-parameter layout costs nothing.

The estimator builds :class:`Layout` itself, never a ``ParallelismConfig``: that refuses
ZeRO with tp or pp, and the plan prices layouts the training code may not run yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm.config import pp_schedule_problem
from llm.errors import ConfigError
from llm.estimate.schedule_steps import bubble_share, peak_state
from llm.models import ModelArgs, blocks_params
from llm.parallel.pipeline import PipelineLayout
from llm.parallel.tensor_parallel import kv_replicated, padded_vocab


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0  # ZeRO over the dp ranks: 0 (replicas), 1, 2, 3
    recompute: str = "none"
    micro_batch: int = 1  # sequences per micro-batch
    microbatches: int = 1  # per step and pipeline (gradient accumulation when pp = 1)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (multi-stage schedules)
    ep: int = 1  # expert parallel ranks among the dp ranks (MoE shapes)

    def __post_init__(self) -> None:
        if self.pp == 1:
            return
        problem = pp_schedule_problem(
            self.schedule, self.pp, self.virtual_stages, self.microbatches
        )
        if problem:
            raise ConfigError(problem)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages


def rank_blocks(n_layers: int, layout: Layout, pp_rank: int) -> int:
    """Blocks pipeline rank ``pp_rank`` holds: its stages (r, r + p, ... looped; r and
    2p - 1 - r V-shaped) of the pipeline's own balanced split."""
    pipe = PipelineLayout(n_layers, layout.pp, layout.virtual_stages, layout.schedule)
    blocks = pipe.stage_blocks()
    return sum(len(blocks[s]) for s in pipe.stages_of(pp_rank))


def block_params(args: ModelArgs, tp: int) -> int:
    """One block's parameters on one tp rank: the split matrices and the column-parallel
    biases (q, k, v, fc) are 1/tp; norms and the row-parallel biases (wo, w2) are whole, and
    so are wk and wv where tensor parallel replicates the kv heads (fewer than tp)."""
    h, kv, f = args.d_model, args.n_kv_heads * args.head_dim, args.d_ff
    if args.family == "gpt2":
        split = 2 * h * h + 2 * h * kv + 2 * h * f + (h + 2 * kv + f)
        return split // tp + 2 * h + 4 * h  # wo, w2 biases; two LayerNorms (gain, bias)
    kv_weights = 2 * h * kv
    if tp > 1 and kv_replicated(args.n_kv_heads, tp):
        return (2 * h * h + 3 * h * f) // tp + kv_weights + 2 * h
    return (2 * h * h + kv_weights + 3 * h * f) // tp + 2 * h  # two RMSNorm gains


def expert_params(args: ModelArgs) -> int:
    """Every routed expert's weights in the model (MoE shapes; 0 for a dense one)."""
    if args.moe is None:
        return 0
    moe_blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return moe_blocks * args.moe.n_experts * 3 * args.d_model * args.d_expert


def a2a_bytes(args: ModelArgs, layout: Layout, seq: int, itemsize: int) -> int:
    """All-to-all bytes one rank sends per step with routing spread evenly: per MoE block
    and micro-batch, the b*s*k assignments of which (ep - 1) / ep leave the rank, out in
    dispatch and back in combine, forward and backward (docs/parallel.md)."""
    if args.moe is None or layout.ep == 1:
        return 0
    moe_blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    leaving = layout.micro_batch * seq * args.moe.top_k * (layout.ep - 1) // layout.ep
    return moe_blocks * layout.microbatches * 4 * leaving * args.d_model * itemsize


def rank_params(args: ModelArgs, layout: Layout, pp_rank: int) -> int:
    """Parameters pipeline rank ``pp_rank`` holds on one tp rank. The first stage has the
    vocab-parallel embedding (vocabulary padded to a multiple of tp) and GPT-2's position
    table (whole); the last the final norm and the head. A tied head is the embedding
    itself when both are on one rank, else the last stage holds its own copy (Megatron's
    embedding group keeps the two equal)."""
    h = args.d_model
    table = padded_vocab(args.vocab_size, layout.tp) * h // layout.tp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if args.moe is None:
        n = rank_blocks(args.n_layers, layout, pp_rank) * block_params(args, layout.tp)
    else:  # MoE shapes run with tp = pp = 1 (llm/validate/): every block, as it is
        n = blocks_params(args) - expert_params(args) * (layout.ep - 1) // layout.ep
    if first:
        n += table + (args.max_seq_len * h if args.family == "gpt2" else 0)
    if last:
        n += h * (2 if args.family == "gpt2" else 1)
        if not (args.tie_embeddings and first):
            n += table
    return n


def in_flight(layout: Layout, pp_rank: int) -> float:
    """Micro-batches in flight on pipeline rank ``pp_rank`` at its peak, in units of one
    micro-batch through all of the rank's blocks (its v stages taken as equal: 1/v each),
    as torch's schedule runs them (llm.estimate.schedule_steps)."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    return sum(peak_state(layout.schedule, p, m, v, pp_rank).saved) / v


def bubble(layout: Layout) -> float:
    """The share of a step a pipeline rank idles, from torch's schedule played out with a
    backward costing two forwards: (p - 1)/(m + p - 1) for gpipe and 1f1b, (p - 1)/(v·m +
    p - 1) interleaved (Narayanan et al. 2021, sections 2.2.1-2.2.2), less under the
    zero-bubble schedules, which fill the idle time with weight gradients."""
    return bubble_share(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def p2p_bytes(args: ModelArgs, layout: Layout, seq: int, itemsize: int) -> int:
    """Bytes one pipeline rank sends per step: for each micro-batch and each of its stage
    boundaries (v of them, interleaved), the b·s·h activation forward and its gradient
    backward (the first rank sends no gradient and the last no activation, so this is the
    middle ranks' figure)."""
    if layout.pp == 1:
        return 0
    per_boundary = layout.micro_batch * seq * args.d_model * itemsize
    return 2 * per_boundary * layout.microbatches * layout.virtual_stages
