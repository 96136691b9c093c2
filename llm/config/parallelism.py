"""``parallelism.*``: the strategy and the dp x tp x pp x ep layout, with the pipeline
schedules' needs (conf/parallelism/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError

STRATEGY_NAMES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "deepspeed")
# torch.distributed.pipelining's schedules, by the names parallelism.pp_schedule takes.
PP_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)
# Schedules that run one stage per rank, and those that place two stages per rank in a V
# (rank r holds stage r and stage 2p-1-r, so the first and last stage share rank 0).
PP_SINGLE_STAGE = frozenset({"gpipe", "1f1b"})
PP_V_SHAPED = frozenset({"zbv_zero_bubble", "dualpipev"})


# Why a data-parallel strategy does not compose with tensor parallel (docs/parallel.md).
_NOT_WITH_TP = {
    "deepspeed": "its engine partitions plain tensors, not DTensor shards",
}


def pp_schedule_problem(name: str, pp: int, v: int, m: int) -> str | None:
    """What a schedule needs of the stages per rank (``v``) and the micro-batch count
    (``m``) at ``pp`` pipeline ranks, as one line naming the fix; None when it has it. The
    estimator's plan asks it of layouts the config does not describe."""
    if name in PP_SINGLE_STAGE and v != 1:
        return (
            f"parallelism.pp_schedule={name} runs one stage per rank but pp_virtual_stages={v}; "
            "set pp_virtual_stages=1 or use pp_schedule=interleaved_1f1b"
        )
    if name in PP_V_SHAPED and v != 2:
        return (
            f"parallelism.pp_schedule={name} places exactly 2 stages per rank in a V; set "
            "parallelism.pp_virtual_stages=2"
        )
    if name not in PP_SINGLE_STAGE | PP_V_SHAPED and v < 2:
        return (
            f"parallelism.pp_schedule={name} interleaves several stages per rank; set "
            "parallelism.pp_virtual_stages >= 2 or use pp_schedule=1f1b"
        )
    if name == "1f1b" and m < pp:
        return (
            f"parallelism.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"pp_microbatches={m} < pp_size={pp}; raise pp_microbatches"
        )
    if name == "dualpipev" and m < pp * v:
        return (
            f"parallelism.pp_schedule=dualpipev needs at least as many micro-batches as its "
            f"{pp * v} stages, got pp_microbatches={m}; raise pp_microbatches"
        )
    rounds = max(1, m // pp)  # as torch's schedule counts them
    if name in ("interleaved_1f1b", "interleaved_zero_bubble") and m % rounds:
        return (
            f"parallelism.pp_schedule={name} runs micro-batches in rounds of pp_size: "
            f"pp_microbatches={m} is not a multiple of {rounds} rounds; use a multiple of "
            f"pp_size={pp}"
        )
    return None


# Why a data-parallel strategy does not compose with pipeline parallel (docs/parallel.md).
_NOT_WITH_PP = {
    "deepspeed": "DeepSpeed pipelines through its own PipelineModule engine, not supported here",
}


def _check_pp_strategy(p: ParallelismConfig) -> None:
    """The data-parallel strategies a pipeline composes with; our ZeRO reduces and gathers
    one stage's buckets per rank (docs/parallel.md)."""
    if p.name in _NOT_WITH_PP:
        raise ConfigError(
            f"parallelism={p.name} with pp_size={p.pp_size}: {_NOT_WITH_PP[p.name]}; use "
            "parallelism=ddp, fsdp or zero1-3 for dp x pp, or single for pp alone"
        )
    if p.name.startswith("zero") and p.pp_schedule not in PP_SINGLE_STAGE:
        raise ConfigError(
            f"parallelism={p.name} with pp_schedule={p.pp_schedule}: our ZeRO buckets one "
            "stage per rank; use pp_schedule=1f1b or gpipe, or parallelism=fsdp"
        )


# Where offloaded state lives; a bool is an older spelling (true: cpu, false: none).
OFFLOAD_TIERS = ("none", "cpu", "nvme")
_OFFLOAD_SPELLINGS = {"true": "cpu", "false": "none"}


def offload_tier(key: str, value) -> str:
    """``value`` as one of OFFLOAD_TIERS (Hydra hands a command line's true over as the
    string "True" to this str field)."""
    tier = _OFFLOAD_SPELLINGS.get(str(value).lower(), str(value).lower())
    require_choice("parallelism", key, tier, OFFLOAD_TIERS)
    return tier


def _check_offload(p: ParallelismConfig) -> None:
    """The strategies each offload tier runs under, and the folder nvme needs."""
    if p.offload_optimizer != "none" and p.name not in ("zero1", "zero2", "zero3", "deepspeed"):
        raise ConfigError(
            f"parallelism.offload_optimizer={p.offload_optimizer} needs zero1-3 or deepspeed, "
            f"not {p.name}; for fsdp use parallelism.offload_params=cpu"
        )
    stage3 = p.name == "zero3" or (p.name == "deepspeed" and p.zero_stage == 3)
    if p.offload_params == "cpu" and not (stage3 or p.name == "fsdp"):
        raise ConfigError(
            "parallelism.offload_params=cpu needs parallelism=fsdp or zero3, or deepspeed with "
            "zero_stage=3"
        )
    if p.offload_params == "nvme" and not stage3:
        raise ConfigError(
            f"parallelism.offload_params=nvme shards parameters to disk under stage 3 only, not "
            f"{p.name}; use parallelism=zero3 (or deepspeed with zero_stage=3)"
        )
    if p.name == "deepspeed" and p.offload_optimizer == "nvme" and p.zero_stage != 3:
        raise ConfigError(
            f"parallelism=deepspeed with zero_stage={p.zero_stage} keeps an nvme-offloaded "
            "optimizer in CPU memory (DeepSpeed swaps to NVMe under stage 3 only); set "
            "parallelism.zero_stage=3 or offload_optimizer=cpu"
        )
    nvme = "nvme" in (p.offload_optimizer, p.offload_params)
    if nvme and not p.nvme_path:
        raise ConfigError(
            "parallelism.offload_*=nvme needs parallelism.nvme_path: a folder on a local disk "
            "with room for the offloaded states"
        )
    if p.nvme_path and not nvme:
        raise ConfigError(
            "parallelism.nvme_path is read only with offload_optimizer=nvme or "
            "offload_params=nvme; set one of them or drop nvme_path"
        )


@dataclass
class ParallelismConfig:
    name: str = "single"  # one of STRATEGY_NAMES
    dp_size: int = -1  # -1: every rank is a data-parallel rank
    tp_size: int = 1  # tensor parallel ranks (innermost mesh dimension); docs/parallel.md
    pp_size: int = 1  # pipeline stages (outermost mesh dimension); docs/parallel.md
    # Expert parallel ranks, splitting each MoE layer's experts over the dp ranks
    # (docs/parallel.md, "Mixture of experts"); ddp, zero1-3 and fsdp.
    ep_size: int = 1
    pp_schedule: str = "1f1b"  # one of PP_SCHEDULES
    # Micro-batches the schedule splits each loader batch into; -1: pp_size.
    pp_microbatches: int = -1
    pp_virtual_stages: int = 1  # stages per rank (interleaved and looped schedules)
    # Indices of the blocks that start stages 1.. (len = stages - 1); None: balanced.
    pp_split: list[int] | None = None
    # tp_size > 1: norms and dropouts on sequence shards (all-gather / reduce-scatter around
    # the split layers instead of all-reduce).
    sequence_parallel: bool = False
    # DDP's all-reduce buckets and our ZeRO's reduce-scatter / all-gather buckets.
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    zero_stage: int = 0  # parallelism=deepspeed only: its ZeRO stage, 0..3
    # Where the optimizer states and fp32 master weights live (OFFLOAD_TIERS): none (the
    # device), cpu (CPU memory, stepped there: ZeRO-Offload) or nvme (files under nvme_path,
    # streamed through CPU memory a bucket at a time: ZeRO-Infinity); zero1-3 and deepspeed.
    # true and false are kept as spellings of cpu and none.
    offload_optimizer: str = "none"
    # Where the sharded parameters live: cpu for fsdp (CPUOffloadPolicy), zero3 and deepspeed
    # stage 3; nvme for zero3 and deepspeed stage 3.
    offload_params: str = "none"
    # offload_*=nvme: the folder (on a fast local disk) each rank's files go under, in a
    # per-run, per-rank subfolder removed at the end of the run.
    nvme_path: str | None = None
    # zero3 and fsdp: gather the next block's parameters while the current one computes.
    prefetch: bool = True
    # fsdp: free gathered parameters after forward (ZeRO-3-like) or keep them (ZeRO-2-like).
    reshard_after_forward: bool = True
    # fsdp: replicas of each shard group (HSDP on a (replicate, shard) mesh); 1 = plain FSDP.
    replicate: int = 1
    # deepspeed: a user's ds_config.json; its "auto" values are filled from our config.
    deepspeed_config: str | None = None
    # zero2/zero3: full-size gradient buckets whose reduce-scatter may be in flight at once
    # (as DeepSpeed's reduce_bucket_size bounds it); a bucket's buffer is freed once its
    # reduce-scatter completes, so peak gradient bytes are 2Φ/N plus this many buckets.
    buckets_in_flight: int = 2
    # Count the bytes handed to each collective (take_sent() and summary.json). Off by default:
    # counting hooks (and DeepSpeed's comms logger, which synchronises every collective)
    # distort step time.
    count_comm: bool = False

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per loader batch (pp_microbatches, -1: pp_size)."""
        return self.pp_size if self.pp_microbatches == -1 else self.pp_microbatches

    def __post_init__(self) -> None:
        require_choice("parallelism", "name", self.name, STRATEGY_NAMES)
        require_positive(
            "parallelism",
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            ep_size=self.ep_size,
            pp_virtual_stages=self.pp_virtual_stages,
            bucket_cap_mb=self.bucket_cap_mb,
            replicate=self.replicate,
        )
        if self.dp_size == 0 or self.dp_size < -1:
            raise ConfigError(
                f"parallelism.dp_size={self.dp_size} must be > 0, or -1 for all ranks"
            )
        require_choice("parallelism", "pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_microbatches == 0 or self.pp_microbatches < -1:
            raise ConfigError(
                f"parallelism.pp_microbatches={self.pp_microbatches} must be > 0, or -1 for pp_size"
            )
        if self.pp_size > 1:
            problem = pp_schedule_problem(
                self.pp_schedule, self.pp_size, self.pp_virtual_stages, self.microbatches
            )
            if problem:
                raise ConfigError(problem)
            _check_pp_strategy(self)
        if self.sequence_parallel and self.tp_size == 1:
            raise ConfigError(
                "parallelism.sequence_parallel=true shards over tensor-parallel ranks; set "
                "parallelism.tp_size > 1 or sequence_parallel=false"
            )
        if self.tp_size > 1 and self.name in _NOT_WITH_TP:
            raise ConfigError(
                f"parallelism={self.name} with tp_size={self.tp_size}: {_NOT_WITH_TP[self.name]}; "
                "use ddp, fsdp or zero1-3 for dp x tp, or single for tp alone"
            )
        if not 0 <= self.zero_stage <= 3:
            raise ConfigError(f"parallelism.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.zero_stage and self.name != "deepspeed":
            raise ConfigError(
                f"parallelism.zero_stage={self.zero_stage} applies to parallelism=deepspeed "
                f"only; use parallelism=zero{self.zero_stage} for our ZeRO"
            )
        self.offload_optimizer = offload_tier("offload_optimizer", self.offload_optimizer)
        self.offload_params = offload_tier("offload_params", self.offload_params)
        _check_offload(self)
        if self.replicate > 1 and self.name != "fsdp":
            raise ConfigError(
                f"parallelism.replicate={self.replicate} (HSDP) needs parallelism=fsdp"
            )
        if self.deepspeed_config is not None and self.name != "deepspeed":
            raise ConfigError("parallelism.deepspeed_config is read by parallelism=deepspeed only")
