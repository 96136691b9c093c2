"""Memory per GPU and step time of one :class:`~llm.estimate.layout.Layout` on a
:class:`~llm.estimate.cluster.Cluster` (docs/parallel.md, "Beyond this machine").

Memory, per pipeline rank (the fullest is the layout's figure): model states by the ZeRO
paper's arithmetic on the rank's own parameters (its blocks' tensor-parallel shards, the
embedding and head where they live), ZeRO over the dp ranks; activations by the formula
(llm/estimate/activations.py, tensor- and sequence-parallel split) times the micro-batches
the schedule keeps in flight on that rank.

Time per step: each micro-batch on the slowest pipeline rank costs its compute at
``flops_per_s`` (or, with ``estimate.device`` naming a device profile, shape by shape at the
rates measured on it: llm.estimate.device_time) plus its tensor-parallel all-reduces (on the critical path, as Megatron's
are) plus the stage-boundary sends; the pipeline stretches m of them by 1/(1 - bubble).
The data-parallel gradient reduction overlaps the last micro-batch's backward and only the
rest shows; ZeRO-3's per-micro-batch parameter gathers are prefetched under compute (a
micro-batch takes the longer of the two).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from llm.config import OptimizerConfig
from llm.estimate.activations import layer_terms, outside_by_stage, outside_terms
from llm.estimate.cluster import Cluster, ring_seconds
from llm.estimate.device_time import compute_seconds
from llm.estimate.layout import (
    Layout,
    a2a_bytes,
    block_params,
    bubble,
    expert_params,
    in_flight,
    p2p_bytes,
    rank_blocks,
    rank_params,
)
from llm.estimate.states import paper_states
from llm.models import ModelArgs, blocks_params
from llm.parallel.tensor_parallel import padded_vocab
from llm.precision import PrecisionPolicy

# Tensor-parallel collectives of b·s·h per block and micro-batch: two in forward, two in
# backward (Shoeybi et al. 2019); full recompute replays the forward's two.
TP_COLLECTIVES = {"none": 4, "selective": 4, "full": 6}


@dataclass
class LayoutEstimate:
    layout: Layout
    # The first and the last pipeline rank (the same one without a pipeline): params,
    # grads, optimizer_states, activations. Every middle rank holds at most what the first
    # holds (no more blocks, fewer micro-batches in flight, no embedding) and computes at
    # most what it computes, so these two bound the layout.
    by_stage: dict[str, dict[str, int]]
    bytes_per_gpu: int  # the fuller of the two
    fits: bool
    step_time_s: float
    bubble: float
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per GPU and step: tp, pp, dp, ep
    # Where the ZeRO states went for the layout to fit: none (it fits as is), cpu (host
    # memory has room for every GPU's) or nvme (only files have room); bytes_per_gpu is then
    # what stays on the device.
    offload: str = "none"


@dataclass(frozen=True)
class Workload:
    """What the layouts are for: the shape, the sequence length, the precision, the
    optimizer, and the attention kernels the activation formula assumes."""

    args: ModelArgs
    seq: int
    policy: PrecisionPolicy
    optimizer: OptimizerConfig
    backend: str = "sdpa"
    device: str = "cuda"

    @property
    def stream(self) -> PrecisionPolicy:
        # Megatron and ZeRO compute with 16-bit working weights: the residual stream is in
        # the working dtype and autocast casts no weights.
        return dataclasses.replace(self.policy, param_dtype=self.policy.working_dtype)


@functools.cache
def _micro_batch_terms(
    args: ModelArgs,
    seq: int,
    stream: PrecisionPolicy,
    backend: str,
    device: str,
    b: int,
    recompute: str,
    tp: int,
    sp: bool,
) -> tuple[int, int, int]:
    """Bytes of one micro-batch: per block, first-stage lookups, last-stage head and loss."""
    split = dict(tp=tp, sequence_parallel=sp)
    kw = dict(backend=backend, device=device, recompute=recompute, **split)
    layer = sum(layer_terms(args, b, seq, stream, **kw).values())
    first, last = outside_by_stage(outside_terms(args, b, seq, stream, device=device, **split))
    return layer, first, last


def _activations(w: Workload, layout: Layout, pp_rank: int) -> int:
    layer, first, last = _micro_batch_terms(
        w.args,
        w.seq,
        w.stream,
        w.backend,
        w.device,
        layout.micro_batch,
        layout.recompute,
        layout.tp,
        layout.sequence_parallel,
    )
    per_micro_batch = rank_blocks(w.args.n_layers, layout, pp_rank) * layer
    per_micro_batch += first * (pp_rank == 0) + last * (pp_rank == layout.pp - 1)
    return round(in_flight(layout, pp_rank) * per_micro_batch)


def _flops_per_token(w: Workload, layout: Layout, pp_rank: int) -> float:
    """Training FLOPs per token on one tp rank of pipeline rank ``pp_rank``: 6 per weight
    plus the attention scores (llm.models.flops_per_token's convention), and the forward
    that recompute replays (full: the whole block; selective: the score and value
    matmuls)."""
    a = w.args
    attention = 12 * w.seq * a.n_heads * a.head_dim
    # A MoE block's weights as a token meets them: top_k of the routed experts.
    weights = block_params(a, 1) if a.moe is None else blocks_params(a, active=True) / a.n_layers
    block = 6 * weights + attention
    replay = {"none": 0.0, "selective": attention / 3, "full": block / 3}[layout.recompute]
    n = rank_blocks(a.n_layers, layout, pp_rank) * (block + replay)
    if pp_rank == layout.pp - 1:
        n += 6 * padded_vocab(a.vocab_size, layout.tp) * a.d_model
    return n / layout.tp


def _compute_s(w: Workload, layout: Layout, pp_rank: int, cluster: Cluster) -> float:
    """One micro-batch's compute on pipeline rank ``pp_rank``: shape by shape from the
    device's profile where estimate.device names one, else every FLOP at flops_per_s."""
    if cluster.profile is not None:
        return compute_seconds(w.args, w.seq, w.backend, layout, pp_rank, cluster.profile)
    return _flops_per_token(w, layout, pp_rank) * layout.micro_batch * w.seq / cluster.flops_per_s


def _offload_tier(
    layout: Layout, by_stage: dict[str, dict[str, int]], total: int, cluster: Cluster
) -> tuple[str, int, float]:
    """A layout too big for its devices, when ZeRO's offload makes it fit: the tier (cpu
    when every GPU's moved states fit the node's host memory, else nvme), the bytes left on
    each GPU, and the step's extra seconds (nvme: the states read and written once per step
    by every GPU of the node at the node's NVMe speed; cpu's PCIe copies are not priced).
    The optimizer states move first; under stage 3 the parameter shards too, if needed.
    Never under expert parallelism: the trainer refuses offload with ep > 1 (expert slices
    step on the device, llm/validate/parallel.py), so the plan does not offer it."""
    if total <= cluster.device_memory or layout.zero_stage == 0 or layout.ep > 1:
        return "none", total, 0.0
    moves = [("optimizer_states",)] + ([("optimizer_states", "params")] * (layout.zero_stage == 3))
    for rows in moves:
        moved = max(sum(s[r] for r in rows) for s in by_stage.values())
        left = max(sum(v for k, v in s.items() if k not in rows) for s in by_stage.values())
        if left > cluster.device_memory:
            continue
        node = moved * cluster.gpus_per_node
        if node <= cluster.host_memory:
            return "cpu", left, 0.0
        return "nvme", left, 2 * node / cluster.nvme
    return "none", total, 0.0


def estimate_layout(w: Workload, layout: Layout, cluster: Cluster) -> LayoutEstimate:
    itemsize = w.policy.working_dtype.itemsize
    b, s, h, m = layout.micro_batch, w.seq, w.args.d_model, layout.microbatches
    stages = {"first": 0, "last": layout.pp - 1}
    by_stage, micro_batch_s, params, tp_payload = {}, 0.0, 0, 0
    for name, r in stages.items():
        n = rank_params(w.args, layout, r)
        params = max(params, n)
        # Expert slices beside the dp sharding: sharded again over their edp ranks at the
        # layout's stage (our zero1-3's second set of buckets; fsdp's FSDP2 on the edp
        # mesh), whole on each edp rank at stage 0 (ddp).
        experts = expert_params(w.args) // layout.ep if layout.ep > 1 else 0
        states = paper_states(n - experts, layout.dp, layout.zero_stage, w.policy, w.optimizer)
        states = states.device
        if experts:
            edp = layout.dp // layout.ep
            held = paper_states(experts, edp, layout.zero_stage, w.policy, w.optimizer).device
            states = {k: v + held[k] for k, v in states.items()}
        by_stage[name] = {**states, "activations": _activations(w, layout, r)}
        compute = _compute_s(w, layout, r, cluster)
        # The blocks' collectives, and the embedding's forward and the head input's
        # backward all-reduce.
        blocks = rank_blocks(w.args.n_layers, layout, r) + (r == 0) + (r == layout.pp - 1)
        payload = blocks * TP_COLLECTIVES[layout.recompute] * b * s * h * itemsize
        payload = payload if layout.tp > 1 else 0
        tp_payload = max(tp_payload, payload)
        tp_s = ring_seconds(payload, layout.tp, cluster.bandwidth(layout.tp), phases=2)
        micro_batch_s = max(micro_batch_s, compute + tp_s)
    pp_bytes = p2p_bytes(w.args, layout, s, itemsize)
    micro_batch_s += pp_bytes / m / cluster.bandwidth(layout.world)
    ep_bytes = a2a_bytes(w.args, layout, s, itemsize)  # on the critical path, not overlapped
    micro_batch_s += ep_bytes / m / cluster.bandwidth(layout.ep) if ep_bytes else 0.0
    dp_bw = cluster.bandwidth(layout.dp * layout.tp)
    reduce = params * w.policy.reduce_dtype.itemsize
    dp_payload, end_phases = 2 * reduce, 2  # all-reduce (or reduce-scatter + all-gather)
    if layout.zero_stage == 3:  # gathers in forward and backward of every micro-batch
        gathers = ring_seconds(2 * params * itemsize, layout.dp, dp_bw, phases=1)
        micro_batch_s = max(micro_batch_s, gathers)
        dp_payload, end_phases = m * 2 * params * itemsize + reduce, 1
    share = bubble(layout)
    pipeline_s = m * micro_batch_s / (1 - share)
    last_backward = 2 / 3 * _compute_s(w, layout, 0, cluster)
    dp_s = ring_seconds(reduce, layout.dp, dp_bw, phases=end_phases)
    total = max(sum(v.values()) for v in by_stage.values())
    offload, total, io_s = _offload_tier(layout, by_stage, total, cluster)
    return LayoutEstimate(
        layout=layout,
        by_stage=by_stage,
        bytes_per_gpu=total,
        fits=total <= cluster.device_memory,
        step_time_s=pipeline_s + max(0.0, dp_s - last_backward) + io_s,
        bubble=share,
        offload=offload,
        comm_bytes={
            "tp": m * tp_payload,
            "pp": pp_bytes,
            "dp": dp_payload if layout.dp > 1 else 0,
            "ep": ep_bytes,
        },
    )
