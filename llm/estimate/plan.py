"""``estimate.plan=true``: every layout of the cluster's devices (dp x tp x pp, a ZeRO stage
over dp, recompute, micro-batch size and count) for the global batch, priced by
llm.estimate.layout_estimate; those that fit first, fastest first, then the rest by memory.
A layout that fits only by offloading its ZeRO states (to host memory, or to NVMe when the
node's host memory is too small: ``offload`` in each row) ranks after every layout that fits
without, cpu before nvme.

Candidates: tp a divisor of gpus_per_node that the heads, d_model and d_ff divide and
that divides the kv heads or is a multiple of them (replicated: llm.parallel.tensor_parallel)
(tensor parallel stays on NVLink, as Megatron advises); pp a divisor of the rest
with at least one block per stage; dp what remains, dividing the global batch; micro-
batches of 1-8 sequences; a pipeline needs at least pp micro-batches and what its schedule
needs of them (llm.config.pp_schedule_problem: the interleaved schedules run whole
rounds). The schedule, virtual stages and sequence parallel are the config's
(parallelism.pp_schedule, pp_virtual_stages, sequence_parallel). A mixture-of-experts shape
runs with tp = pp = 1, and tries every expert-parallel size ep that divides the devices and
n_experts instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from llm.config import Config, pp_schedule_problem
from llm.errors import ConfigError
from llm.estimate.cluster import Cluster
from llm.estimate.estimator import estimate_attention, estimate_policy
from llm.estimate.layout import Layout
from llm.estimate.layout_estimate import LayoutEstimate, Workload, estimate_layout
from llm.models import ModelArgs
from llm.parallel.tensor_parallel import kv_heads_placeable

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(cfg: Config, world: int) -> int:
    """Sequences per step: estimate.global_batch, or the run's own per-rank batch on every
    device."""
    t = cfg.train
    return cfg.estimate.global_batch or t.micro_batch_size * t.grad_accum_steps * world


def layouts(cfg: Config, args: ModelArgs, cluster: Cluster, batch: int) -> Iterator[Layout]:
    par = cfg.parallelism
    if args.moe is not None:  # tensor and pipeline parallel do not split MoE blocks here
        yield from _expert_layouts(args, cluster, batch)
        return
    for tp in _divisors(cluster.gpus_per_node):
        sizes = (args.n_heads, args.d_model, args.d_ff)
        if any(x % tp for x in sizes) or not kv_heads_placeable(args.n_kv_heads, tp):
            continue
        if par.sequence_parallel and cfg.data.seq_len % tp:
            continue
        for pp in _divisors(cluster.world // tp):
            dp = cluster.world // (tp * pp)
            v = par.pp_virtual_stages if pp > 1 else 1
            if pp * v > args.n_layers or batch % dp:
                continue
            for b in MICRO_BATCHES:
                m, rest = divmod(batch // dp, b)
                schedule = par.pp_schedule if pp > 1 else "1f1b"
                if rest or m < pp or (pp > 1 and pp_schedule_problem(schedule, pp, v, m)):
                    continue
                for zero in ZERO_STAGES:
                    for recompute in RECOMPUTES:
                        yield Layout(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            zero_stage=zero,
                            recompute=recompute,
                            micro_batch=b,
                            microbatches=m,
                            sequence_parallel=par.sequence_parallel and tp > 1,
                            schedule=schedule,
                            virtual_stages=v,
                        )


def _expert_layouts(args: ModelArgs, cluster: Cluster, batch: int) -> Iterator[Layout]:
    """MoE shapes: every rank data-parallel, ep any divisor of dp and of n_experts."""
    dp = cluster.world
    if batch % dp:
        return
    for ep in (e for e in _divisors(dp) if args.moe.n_experts % e == 0):
        for b in MICRO_BATCHES:
            m, rest = divmod(batch // dp, b)
            if rest or m < 1:
                continue
            for zero in ZERO_STAGES:
                for recompute in RECOMPUTES:
                    yield Layout(
                        dp=dp, zero_stage=zero, recompute=recompute, micro_batch=b,
                        microbatches=m, ep=ep,
                    )  # fmt: skip


def plan(cfg: Config, args: ModelArgs) -> list[LayoutEstimate]:
    cluster = Cluster.from_config(cfg)
    batch = global_batch(cfg, cluster.world)
    work = Workload(
        args=args,
        seq=cfg.data.seq_len,
        policy=estimate_policy(cfg.precision.name, cfg.estimate.kernels, cfg.precision.fp8_recipe),
        optimizer=cfg.optimizer,
        backend=estimate_attention(cfg, args).backend,
        device=cfg.estimate.kernels,
    )
    rows = [estimate_layout(work, lay, cluster) for lay in layouts(cfg, args, cluster, batch)]
    if not rows:
        raise ConfigError(
            f"no layout of {cluster.world} devices divides the global batch of {batch} "
            "sequences; set estimate.global_batch to a multiple of the data-parallel sizes"
        )
    tier = {"none": 0, "cpu": 1, "nvme": 2}
    return sorted(
        rows,
        key=lambda r: (
            not r.fits,
            tier[r.offload],
            r.step_time_s if r.fits else r.bytes_per_gpu,
        ),
    )


def plan_row(est: LayoutEstimate) -> dict:
    """One layout as estimate.json's plan lists it."""
    lay = est.layout
    return {
        "dp": lay.dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "ep": lay.ep,
        "zero_stage": lay.zero_stage,
        "recompute": lay.recompute,
        "microbatches": lay.microbatches,
        "micro_batch": lay.micro_batch,
        "bytes_per_gpu": est.bytes_per_gpu,
        "fits": est.fits,
        "offload": est.offload,
        "step_time_s": est.step_time_s,
        "bubble": est.bubble,
        "comm_bytes_per_gpu": est.comm_bytes,
        "a2a_bytes": est.comm_bytes.get("ep", 0),
        "by_stage": est.by_stage,
    }
