"""Typed configuration: one dataclass per Hydra config group, registered in a ConfigStore.

YAML files under conf/ fill these schemas; Hydra refuses unknown keys and wrong types, and the
``__post_init__`` checks here refuse impossible values with one line naming the problem and
the fix, before any rank starts. Cross-group checks live in :func:`validate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from llm.errors import ConfigError


def _require_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}.{name}={value} must be > 0; set a positive value")


def _require_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{owner}.{name}={value!r} is unknown; choose one of {', '.join(choices)}"
        )


@dataclass
class MoEConfig:
    """Overrides of a mixture-of-experts shape's MoEArgs (llm/models/args.py says what each
    field does); null keeps the shape's value. Any key set on a dense shape is refused."""

    n_experts: int | None = None
    top_k: int | None = None
    d_expert: int | None = None
    n_shared_experts: int | None = None
    every: int | None = None
    first_dense: int | None = None
    router: str | None = None  # softmax | sigmoid
    norm_topk: bool | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    bias_update_rate: float | None = None
    # Every shape here is dropless (no capacity); a number sets one.
    capacity_factor: float | None = None
    kernel: str | None = None  # auto | grouped | loop


@dataclass
class ModelConfig:
    """A model from the registry (llm.models.MODEL_SHAPES); the fields below override its shape."""

    name: str = "gpt2-tiny"
    init_from: str | None = None  # a local Hugging Face checkpoint directory to load weights from
    # None: the tokenizer's vocabulary size; a published shape's conf/model/*.yaml sets its own.
    vocab_size: int | None = None
    max_seq_len: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    d_ff: int | None = None
    dropout: float = 0.0
    # Rows of the embedding and head rounded up to a multiple of this (x tp_size under tensor
    # parallel), e.g. 128 for tensor-core tiles; the padded ids are never tokens (logits -inf).
    vocab_multiple: int = 1
    # Globs over parameter names (fnmatch), e.g. ["tok_embeddings.*", "layers.0.*"]: frozen
    # parameters get no gradient, no optimizer state and no update under every strategy.
    freeze: list[str] = field(default_factory=list)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        _require_positive(
            "model",
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            vocab_multiple=self.vocab_multiple,
        )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


SDPA_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass
class AttentionConfig:
    # auto (the fastest the committed GPU records show for this device and shape, else sdpa:
    # llm/attention/auto.py) | eager | sdpa | flash_attn | flex | triton | xformers (BACKENDS)
    backend: str = "auto"
    # sdpa only: torch picks (auto) or this kernel alone; one that cannot run is refused.
    sdpa_kernel: str = "auto"  # auto | flash | efficient | cudnn | math
    # Packed documents (data.packing=true) attend only inside themselves, causal inside.
    document_mask: bool = False
    # With document_mask: positions (RoPE, learned) restart at 0 at each document.
    reset_positions: bool = False

    def __post_init__(self) -> None:
        _require_choice("attention", "sdpa_kernel", self.sdpa_kernel, SDPA_KERNELS)
        if self.sdpa_kernel != "auto" and self.backend != "sdpa":
            raise ConfigError(
                f"attention.sdpa_kernel={self.sdpa_kernel} applies to attention=sdpa only, not "
                f"{self.backend}; drop it or use attention=sdpa"
            )
        if self.reset_positions and not self.document_mask:
            raise ConfigError(
                "attention.reset_positions=true restarts positions at packed documents, which "
                "needs attention.document_mask=true"
            )


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
LOSS_SCALER_PRESETS = ("deepspeed", "megatron", "torch")


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


@dataclass
class ParallelismConfig:
    name: str = "single"  # one of STRATEGY_NAMES
    dp_size: int = -1  # -1: every rank is a data-parallel rank
    tp_size: int = 1  # tensor parallel ranks (innermost mesh dimension); docs/parallel.md
    pp_size: int = 1  # pipeline stages (outermost mesh dimension); docs/parallel.md
    # Expert parallel ranks, splitting each MoE layer's experts over the dp ranks
    # (docs/parallel.md, "Mixture of experts"); parallelism=ddp only, so far.
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
    # Optimizer states (and fp32 master weights) in CPU memory, stepped there (ZeRO-Offload):
    # zero1-3 and deepspeed.
    offload_optimizer: bool = False
    # Sharded parameters in CPU memory: fsdp (CPUOffloadPolicy) and deepspeed stage 3.
    offload_params: bool = False
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
    # Count the bytes handed to each collective (comm() and summary.json). Off by default:
    # counting hooks (and DeepSpeed's comms logger, which synchronises every collective)
    # distort step time.
    count_comm: bool = False

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per loader batch (pp_microbatches, -1: pp_size)."""
        return self.pp_size if self.pp_microbatches == -1 else self.pp_microbatches

    def __post_init__(self) -> None:
        _require_choice("parallelism", "name", self.name, STRATEGY_NAMES)
        _require_positive(
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
        _require_choice("parallelism", "pp_schedule", self.pp_schedule, PP_SCHEDULES)
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
        if self.offload_optimizer and self.name not in ("zero1", "zero2", "zero3", "deepspeed"):
            raise ConfigError(
                f"parallelism.offload_optimizer=true needs zero1-3 or deepspeed, not "
                f"{self.name}; for fsdp use parallelism.offload_params=true"
            )
        if self.offload_params and not (
            self.name == "fsdp" or (self.name == "deepspeed" and self.zero_stage == 3)
        ):
            raise ConfigError(
                "parallelism.offload_params=true needs parallelism=fsdp, or deepspeed with "
                "zero_stage=3"
            )
        if self.replicate > 1 and self.name != "fsdp":
            raise ConfigError(
                f"parallelism.replicate={self.replicate} (HSDP) needs parallelism=fsdp"
            )
        if self.deepspeed_config is not None and self.name != "deepspeed":
            raise ConfigError("parallelism.deepspeed_config is read by parallelism=deepspeed only")


@dataclass
class PrecisionConfig:
    name: str = "auto"  # auto | fp32 | tf32 | fp16 | bf16 | bf16_pure | fp8
    # Dynamic loss scaling (fp16): a preset's defaults (docs/references.md), each overridable.
    loss_scaler: str = "deepspeed"  # deepspeed | megatron | torch
    static_loss_scale: float = 0.0  # > 0: a fixed scale (as DeepSpeed's loss_scale; 0 = dynamic)
    initial_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    hysteresis: int | None = None  # overflows tolerated before backing off (1 = none)
    consecutive_hysteresis: bool = False  # refill hysteresis after every clean step
    min_scale: float | None = None
    # Overflowing steps in a row at the minimum scale (or under a static scale) before the
    # run stops with an error naming the parameters whose gradients are not finite.
    max_overflows_at_min_scale: int = 3
    # bf16_pure: how an update smaller than a bf16 ulp still reaches the weight.
    update_rounding: str = "stochastic"  # stochastic | kahan
    # What gradients are reduced in across data-parallel ranks: None is the policy's own
    # (fp32 under fp16/bf16 mixed precision); fp32 | bf16 | fp16 to override.
    reduce_dtype: str | None = None
    # precision=fp8: how the GEMMs' fp8 inputs are scaled (llm/precision/fp8/): tensorwise
    # (one scale a tensor, torchao's default), rowwise (one a row, torchao's), deepseek
    # (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks, e4m3 throughout).
    fp8_recipe: str = "tensorwise"
    # Quantise and dequantise in fp32 (the recipe's rounding, not its speed): null picks it
    # where the real kernels cannot run (no fp8 tensor cores; torchao missing for tensorwise
    # and rowwise, triton for deepseek's GEMM of ours); false refuses to emulate.
    fp8_emulate: bool | None = None
    # Every k-th step, each fp8 linear records its operands' quantisation error and
    # saturation (llm.precision.fp8.record_fp8_stats) into summary.json's fp8_stats; 0: never.
    # Our fp8 linears only: torchao's Float8Linear records nothing.
    fp8_stats_every: int = 0

    def __post_init__(self) -> None:
        _require_choice(
            "precision",
            "name",
            self.name,
            ("auto", "fp32", "tf32", "fp16", "bf16", "bf16_pure", "fp8"),
        )
        _require_choice("precision", "loss_scaler", self.loss_scaler, LOSS_SCALER_PRESETS)
        _require_choice(
            "precision", "fp8_recipe", self.fp8_recipe, ("tensorwise", "rowwise", "deepseek")
        )
        _require_choice(
            "precision", "update_rounding", self.update_rounding, ("stochastic", "kahan")
        )
        _require_positive(
            "precision",
            initial_scale=self.initial_scale,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_overflows_at_min_scale=self.max_overflows_at_min_scale,
        )
        if self.fp8_stats_every < 0:
            raise ConfigError(
                f"precision.fp8_stats_every={self.fp8_stats_every} must be >= 0 (0: never)"
            )
        if self.static_loss_scale < 0:
            raise ConfigError(
                f"precision.static_loss_scale={self.static_loss_scale} must be >= 0 (0: dynamic)"
            )
        if self.growth_factor is not None and self.growth_factor <= 1:
            raise ConfigError(f"precision.growth_factor={self.growth_factor} must be > 1")
        if self.backoff_factor is not None and not 0 < self.backoff_factor < 1:
            raise ConfigError(f"precision.backoff_factor={self.backoff_factor} must be in (0, 1)")


@dataclass
class OptimizerConfig:
    """One optimizer from the registry (llm.optim.OPTIMIZERS; docs/optimizers.md). Fields an
    optimizer does not use are ignored by it; conf/optimizer/NAME.yaml holds its defaults."""

    name: str = "adamw"  # adamw | sgd | adafactor | lamb | lion | sophia | muon | adamw8bit
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd; muon's Nesterov momentum
    # None: adamw and muon's AdamW part fused where torch has the kernel (CUDA, CPU params),
    # else torch's foreach; sgd: torch picks. true/false are honoured where the kernel runs.
    fused: bool | None = None
    # lamb: Adam's bias correction of both moments, and the bound on ||w|| in the trust ratio
    bias_correction: bool = True
    trust_clip: float = 10.0
    # sophia: the clipping scale rho, and a Hessian estimate every k steps
    rho: float = 0.04
    hessian_every: int = 10
    # adafactor (torch.optim.Adafactor): beta2_t = 1 - t^beta2_decay, eps2, update clip d
    beta2_decay: float = -0.8
    eps2: float = 1e-3
    clip_threshold: float = 1.0
    # muon (llm/optim/muon.py on hidden matrices): Newton-Schulz steps and their dtype, lr
    # adjustment, and how sharded strategies orthogonalise: every rank gathers the whole
    # matrices it holds a piece of (gather, Moonlight's Distributed Muon) or one owner per
    # matrix computes it and scatters the pieces back (owner)
    ns_steps: int = 5
    ns_dtype: str = "bfloat16"  # bfloat16 (torch.optim.Muon's) | float32
    adjust_lr: str = "match_rms_adamw"  # match_rms_adamw | original
    distributed: str = "gather"  # gather | owner
    # adamw8bit: tensors smaller than this keep fp32 moments (bitsandbytes' min_8bit_size)
    min_8bit_size: int = 4096

    def __post_init__(self) -> None:
        _require_positive(
            "optimizer",
            lr=self.lr,
            eps=self.eps,
            trust_clip=self.trust_clip,
            rho=self.rho,
            hessian_every=self.hessian_every,
            eps2=self.eps2,
            clip_threshold=self.clip_threshold,
            ns_steps=self.ns_steps,
            min_8bit_size=self.min_8bit_size,
        )
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} must be two values in [0, 1)")
        if not -1.0 <= self.beta2_decay < 0.0:
            raise ConfigError(f"optimizer.beta2_decay={self.beta2_decay} must be in [-1, 0)")
        _require_choice("optimizer", "adjust_lr", self.adjust_lr, ("match_rms_adamw", "original"))
        _require_choice("optimizer", "ns_dtype", self.ns_dtype, ("bfloat16", "float32"))
        _require_choice("optimizer", "distributed", self.distributed, ("gather", "owner"))


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the final lr as a fraction of optimizer.lr
    decay_ratio: float = 0.2  # wsd: the share of steps spent decaying at the end

    def __post_init__(self) -> None:
        _require_choice("scheduler", "name", self.name, ("cosine", "linear", "constant", "wsd"))
        if self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ConfigError(f"scheduler.decay_ratio={self.decay_ratio} must be in (0, 1]")


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | wikitext2 | wikitext103 | files
    path: str | None = None  # data=files: a file, folder or glob (.txt/.md/.py, .jsonl, .parquet)
    text_field: str = "text"  # the column holding text in jsonl / parquet / hub datasets
    hub_id: str | None = None  # wikitext: None is Salesforce/wikitext; or a local copy of that repo
    tokenizer: str = "bpe"  # byte | bpe | a local HF tokenizer folder or tokenizer.json
    vocab_size: int = 4096  # bpe only
    tokenizer_train_bytes: int = 8_000_000  # bpe is trained on this much of the train split
    seq_len: int = 256
    packing: bool = True  # False: one document per sample, padded, targets masked
    val_fraction: float = 0.02  # stdlib / files: share of files (one file: documents) held out
    val_samples: int = 256  # validation: the first N samples of the val split, whatever the batch
    cache_dir: str = "${oc.env:LLM_CACHE_DIR,.cache/llm}"  # tokenizers and token caches
    # Training batches a background thread reads (and on CUDA pins) ahead of the step;
    # 0 reads each one when the step asks for it (llm/data/prefetch.py).
    prefetch: int = 2

    def __post_init__(self) -> None:
        _require_choice("data", "name", self.name, ("stdlib", "wikitext2", "wikitext103", "files"))
        if self.prefetch < 0:
            raise ConfigError(
                f"data.prefetch={self.prefetch} must be >= 0; 0 reads each batch when the step "
                "asks for it"
            )
        _require_positive(
            "data",
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            tokenizer_train_bytes=self.tokenizer_train_bytes,
            val_samples=self.val_samples,
        )
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.name == "files" and not self.path:
            raise ConfigError("data=files needs data.path=PATH (a file, folder or glob)")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ConfigError(
                f"data.vocab_size={self.vocab_size} is below the 256 bytes + <|endoftext|> a "
                "byte-level BPE starts from; use >= 257 (or data.tokenizer=byte)"
            )


RECOMPUTE_NAMES = ("none", "full", "selective", "op_sac", "budget", "offload")


@dataclass
class RecomputeConfig:
    """Which activations are kept for backward (llm/recompute, docs/recompute.md)."""

    name: str = "none"  # none | full | selective | op_sac | budget | offload
    every: int = 1  # full: recompute every k-th block (1 = all blocks)
    # op_sac: keep only every other linear matmul's output (torchtitan's option).
    save_every_other_mm: bool = False
    # budget: the compiler's activation memory budget, 0 (recompute most) to 1 (keep most).
    memory_budget: float = 0.5

    def __post_init__(self) -> None:
        _require_choice("recompute", "name", self.name, RECOMPUTE_NAMES)
        _require_positive("recompute", every=self.every)
        if not 0.0 <= self.memory_budget <= 1.0:
            raise ConfigError(
                f"recompute.memory_budget={self.memory_budget} must be in [0, 1]; "
                "0 recomputes all it can, 1 keeps what the default partition keeps"
            )
        if self.save_every_other_mm and self.name != "op_sac":
            raise ConfigError(
                f"recompute.save_every_other_mm=true applies to recompute=op_sac only, not "
                f"recompute={self.name}; drop it or use recompute=op_sac"
            )


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none (metrics.jsonl and summary.json are always written)
    project: str = "llm-training-lab"
    entity: str | None = None
    mode: str = "auto"  # auto: online when W&B credentials exist, else offline
    group: str | None = None  # None: the sweep directory name under -m, else no group
    tags: list[str] = field(default_factory=list)
    progress: bool = True  # the rank-0 progress bar

    def __post_init__(self) -> None:
        _require_choice("logger", "name", self.name, ("wandb", "none"))
        _require_choice("logger", "mode", self.mode, ("auto", "online", "offline", "disabled"))


@dataclass
class MonitorConfig:
    name: str = "default"  # default | none
    stop_on_nan: bool = True
    loss_spike_factor: float = 3.0  # alert when loss > factor * its running mean
    grad_norm_alert: float = 100.0  # alert when the pre-clip grad norm exceeds this
    max_alerts: int = 20

    def __post_init__(self) -> None:
        _require_choice("monitor", "name", self.name, ("default", "none"))


@dataclass
class LauncherConfig:
    name: str = "local"
    nproc_per_node: int = 1
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port is picked per job (safe for -m sweeps)
    # CPU ranks beyond the cores this process may use are warned about, and beyond 4 per
    # core refused (each rank holds a whole model and they fight for the cores), unless
    # this says it is meant (llm/validate.py).
    allow_oversubscribe: bool = False

    def __post_init__(self) -> None:
        _require_positive("launcher", nproc_per_node=self.nproc_per_node)
        _require_choice("launcher", "backend", self.backend, ("auto", "gloo", "nccl"))


FUSED_LOSSES = ("off", "chunked", "liger", "cce")
COMPILE_MODES = ("default", "max-autotune", "reduce-overhead")


@dataclass
class TrainConfig:
    max_steps: int = 300  # the schedule's length
    stop_at_step: int | None = None  # end this invocation here (time-boxed jobs); resume later
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    grad_clip: float = 1.0  # 0 disables clipping
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False
    # torch.compile's mode with train.compile: default, max-autotune (Inductor benchmarks
    # kernel configs at compile time) or reduce-overhead (CUDA graphs where the step allows
    # them; on a CPU it compiles as default).
    compile_mode: str = "default"  # default | max-autotune | reduce-overhead
    deterministic: bool = False
    # Which steps probe memory (llm/train/probes.py): step 1 and the logged steps (default),
    # every other step, or the same steps without the peak tracker. A probe is never timed.
    memory_tracking: str = "logged"  # logged | alternate | off
    # The loss with the LM head fused in, never holding the (B*T, V) fp32 logits at once
    # (llm/train/loss.py): off (logits, then the loss), chunked (plain torch, any device),
    # liger (Liger-Kernel) or cce (Apple's cut-cross-entropy), both Triton on CUDA.
    fused_loss: str = "off"  # off | chunked | liger | cce
    # chunked: rows of logits at a time, each chunk x V fp32 (plus its compute-dtype matmul
    # output): 1024 rows of a 50k vocabulary are ~0.3 GB, 1/16 of a 16 x 1024 batch's.
    fused_loss_chunk: int = 1024

    def __post_init__(self) -> None:
        _require_positive(
            "train",
            max_steps=self.max_steps,
            fused_loss_chunk=self.fused_loss_chunk,
            micro_batch_size=self.micro_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            log_every=self.log_every,
            eval_every=self.eval_every,
        )
        if self.stop_at_step is not None and not 0 < self.stop_at_step <= self.max_steps:
            raise ConfigError(
                f"train.stop_at_step={self.stop_at_step} must be in 1..train.max_steps={self.max_steps}"
            )
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables)")
        _require_choice("train", "device", self.device, ("auto", "cpu", "cuda"))
        if self.memory_tracking == "every_step":
            raise ConfigError(
                "train.memory_tracking=every_step is now alternate: a tracked step is never "
                "timed, so at most every other step is tracked; use train.memory_tracking=alternate"
            )
        _require_choice(
            "train", "memory_tracking", self.memory_tracking, ("logged", "alternate", "off")
        )
        _require_choice("train", "fused_loss", self.fused_loss, FUSED_LOSSES)
        _require_choice("train", "compile_mode", self.compile_mode, COMPILE_MODES)
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(
                f"train.compile_mode={self.compile_mode} applies only to a compiled model; "
                "add train.compile=true"
            )


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end of training
    keep_last: int = 2
    resume: str = "auto"  # auto | none | PATH
    enabled: bool = True
    # Tensor bytes per file: torch DCP's writer holds a file's tensors (copies of shards that
    # are views) until the file is closed, so this bounds a save's temporary memory.
    file_mb: float = 25.0  # as parallelism.bucket_cap_mb

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0: only at the end)")
        _require_positive("checkpoint", keep_last=self.keep_last, file_mb=self.file_mb)


@dataclass
class EstimateConfig:
    """``python -m llm.estimate`` (docs/recompute.md, "The memory estimator"; docs/parallel.md,
    "Beyond this machine")."""

    # train: a training run's bytes per rank; inference: what one tensor-parallel rank of
    # python -m llm.generate holds (weights + KV cache + the largest forward's transients,
    # all in generate.dtype, which the cache shares with the weights as llm.generate builds
    # it) and the largest batch and longest context that fit (docs/inference.md).
    mode: str = "train"
    # inference only (refused in train mode): sequences decoding at once (None: 1), and
    # tokens per sequence, prompt and new ones (None: the model's max_seq_len).
    batch: int | None = None
    context: int | None = None
    json: str | None = None  # also write the figures to this JSON file
    plan: bool = False  # rank the dp x tp x pp x ZeRO x recompute x micro-batch layouts that fit
    # What the estimate is for: cuda | cpu (kernels and dropout masks), or a GPU with a device
    # profile (h100, h200; a100 scaled from one; a profile .yaml's path): CUDA kernels, and
    # the plan's compute at that GPU's measured rates (llm.estimate.device_profile).
    device: str = "cuda"
    # The cluster: nodes x gpus_per_node devices of device_memory_gb GiB each.
    nodes: int = 1
    gpus_per_node: int | None = None  # None: launcher.nproc_per_node
    device_memory_gb: float = 80.0
    rank: int = 0  # whose shard to show (ranks differ by a few padding elements)
    # A model-states-only estimate for a bare parameter count (the ZeRO paper's 7.5e9).
    num_params: float | None = None
    # The plan's time model: sustained matmul FLOP/s per device, and per-GPU link speeds
    # inside a node (NVLink: H100's 450 GB/s a direction) and between nodes (InfiniBand:
    # one 400 Gb/s NIC per GPU).
    flops_per_s: float = 400e12
    intra_node_gb_s: float = 450.0
    inter_node_gb_s: float = 50.0
    # The plan's global batch in sequences per step; None: train.micro_batch_size x
    # train.grad_accum_steps x every device.
    global_batch: int | None = None
    plan_rows: int = 20  # layouts the plan's table prints (estimate.json gets all)

    def __post_init__(self) -> None:
        _require_choice("estimate", "mode", self.mode, ("train", "inference"))
        _require_positive("estimate", batch=self.batch, context=self.context)
        if self.mode == "train" and (self.batch, self.context) != (None, None):
            raise ConfigError(
                "estimate.batch and estimate.context size an inference estimate; add "
                "estimate.mode=inference, or drop them (training uses train.micro_batch_size "
                "and data.seq_len)"
            )
        _require_positive(
            "estimate",
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            device_memory_gb=self.device_memory_gb,
            num_params=self.num_params,
            flops_per_s=self.flops_per_s,
            intra_node_gb_s=self.intra_node_gb_s,
            inter_node_gb_s=self.inter_node_gb_s,
            global_batch=self.global_batch,
            plan_rows=self.plan_rows,
        )
        if self.rank < 0:
            raise ConfigError(f"estimate.rank={self.rank} must be >= 0")

    @property
    def kernels(self) -> str:
        """The device whose kernels the estimate sizes: cpu, or cuda for every GPU."""
        return "cpu" if self.device == "cpu" else "cuda"


@dataclass
class GenerateConfig:
    """``python -m llm.generate`` (docs/inference.md): sample from a trained or imported model.

    The model comes from ``run_dir`` (its newest checkpoint that verifies) or ``checkpoint``
    (a checkpoint folder of ours, or a Hugging Face model folder); prompts from ``prompt`` or
    ``prompts_file`` (one per line, batched together)."""

    run_dir: str | None = None
    checkpoint: str | None = None
    # None: the run's own (saved beside its checkpoints), or the HF folder's; else byte, a
    # tokenizer.json or a tokenizer folder, checked against the one the checkpoint trained on.
    tokenizer: str | None = None
    prompt: str | None = None
    prompts_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0
    stop_at_eos: bool = True
    paged: bool = True  # the KV cache in blocks (PagedAttention) or one slab per sequence
    block_size: int = 16  # tokens per KV block
    # The KV cache's budget in tokens over all sequences; None: every prompt's longest
    # possible sequence (prompt + max_new_tokens, at most the model's max_seq_len).
    cache_tokens: int | None = None
    # The paged cache's attention read: gather (blocks gathered, then SDPA: any device),
    # triton (our kernel reading the block table), flex (FlexAttention over the blocks);
    # auto: triton on CUDA, gather elsewhere.
    kernel: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16

    def __post_init__(self) -> None:
        _require_positive(
            "generate", max_new_tokens=self.max_new_tokens, block_size=self.block_size
        )
        _require_positive("generate", cache_tokens=self.cache_tokens)
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"generate.temperature={self.temperature}, top_k={self.top_k}, top_p="
                f"{self.top_p}: need temperature >= 0 (0: greedy), top_k >= 0 (0: off) and "
                "0 < top_p <= 1"
            )
        _require_choice("generate", "kernel", self.kernel, ("auto", "gather", "triton", "flex"))
        _require_choice("generate", "device", self.device, ("auto", "cpu", "cuda"))
        _require_choice("generate", "dtype", self.dtype, ("auto", "fp32", "bf16", "fp16"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    output_dir: str = "outputs/run"  # conf/config.yaml points it at Hydra's run directory
    sweep_name: str | None = None  # set by train.py under -m: the W&B group


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "parallelism": ParallelismConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "recompute": RecomputeConfig,
    "logger": LoggerConfig,
    "monitor": MonitorConfig,
    "launcher": LauncherConfig,
}


def register_configs() -> None:
    """Register the root schema and one schema per group, so every YAML is type-checked.

    Group schemas sit at the top level (``/model_schema``, pulled in by each option's
    defaults as ``/model_schema@_here_``), not inside their group: there Hydra would offer
    ``model=model_schema`` as an option, which runs the dataclass defaults."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, schema in GROUPS.items():
        cs.store(name=f"{group}_schema", node=schema)


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a DictConfig or dict) that ``schema`` does not declare, at
    any depth of nested dataclasses."""
    hints = typing.get_type_hints(schema)
    found = []
    for key in node:
        name = f"{prefix}{key}"
        if key not in hints:
            found.append(name)
        elif dataclasses.is_dataclass(hints[key]) and hasattr(node[key], "keys"):
            found.extend(unknown_keys(node[key], hints[key], f"{name}."))
    return found


def _refuse_unknown_keys(cfg: Any) -> None:
    # Hydra's `+key=value` adds a key to a typed node, and OmegaConf.to_object keeps it as
    # a stray attribute: a typo like +train.max_stepz=5 would be silently ignored.
    unknown = unknown_keys(cfg, Config)
    if not unknown:
        return
    raise ConfigError(unknown_key_message(unknown[0]))


def unknown_key_message(key: str) -> str:
    """One line for a dotted ``key`` whose last part its parent's schema does not declare:
    the closest declared key, and the parent's keys."""
    parent, _, leaf = key.rpartition(".")
    schema = Config
    for part in filter(None, parent.split(".")):
        schema = typing.get_type_hints(schema)[part]
    known = [f.name for f in dataclasses.fields(schema)]
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
    return (
        f"{key} is not a config key; {hint}remove it or fix its name "
        f"(keys of {parent or 'the root'}: {', '.join(known)})"
    )


def first_unknown_part(key: str) -> str | None:
    """The prefix of dotted ``key`` up to its first part the schema does not declare, or
    None when every part down to a non-dataclass field (a dict, a list, a value) exists."""
    schema: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return ".".join(parts[: i + 1])
        schema = hints[part]
        if not dataclasses.is_dataclass(schema):
            return None
    return None


def to_dataclass(cfg: Any) -> Config:
    """Turn a resolved DictConfig into a Config; unknown keys are refused and the
    __post_init__ checks run here."""
    from omegaconf import OmegaConf

    _refuse_unknown_keys(cfg)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))


__all__ = [
    "GROUPS",
    "MISSING",
    "Config",
    "first_unknown_part",
    "register_configs",
    "to_dataclass",
    "unknown_key_message",
    "unknown_keys",
]
