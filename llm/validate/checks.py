"""Cross-group checks on a whole Config, run once before any rank starts.

Each failure is a ConfigError with one line naming the problem and the fix; single-group
checks live in the dataclasses' ``__post_init__`` (llm/config/).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from llm.attention import check_kernel, get_kernel, resolve_for
from llm.build import model_args_for, resolve_device, tokenizer_vocab_size
from llm.config import Config
from llm.errors import ConfigError
from llm.models import HFSource, ModelArgs, build_model, freeze
from llm.optim import ELEMENTWISE, OPTIMIZERS
from llm.parallel.mesh import ParallelDims
from llm.parallel.pipeline import check_layout
from llm.parallel.strategy import refuse_optimizer
from llm.parallel.tensor_parallel import check_tensor_parallel, kv_replicated
from llm.precision import precision_for
from llm.precision.fp8 import convert_to_fp8
from llm.train.checkpoint_files import META, list_checkpoints, step_of
from llm.train.loss import unavailable as fused_loss_unavailable

log = logging.getLogger(__name__)
# Local CPU ranks per usable core beyond which a run is refused without
# launcher.allow_oversubscribe=true: 64 ranks on 2 cores took 4 minutes to step 1 and 16 GB.
RANKS_PER_CORE_LIMIT = 4
# The strategies that hold expert slices (parallelism.ep_size > 1).
EP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def check_vocab(cfg: Config, args: ModelArgs) -> None:
    """Refuse a model.vocab_size (a published shape's config sets it) smaller than the
    tokenizer's where that is known from the config (byte, bpe): the run would refuse it
    once the tokenizer is built (llm.run), after the data is prepared."""
    if cfg.model.init_from is not None or cfg.data.tokenizer not in ("byte", "bpe"):
        return
    tokens = tokenizer_vocab_size(cfg)
    if args.vocab_size < tokens:
        raise ConfigError(
            f"model vocab_size={args.vocab_size} is smaller than the tokenizer's {tokens}; "
            "set model.vocab_size or use another data.tokenizer"
        )


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Refuse impossible combinations. ``world_size`` is known under torchrun/Slurm."""
    args = model_args_for(cfg)
    check_vocab(cfg, model_args_for(cfg, tokenizer_vocab_size(cfg)))
    if cfg.data.seq_len > args.max_seq_len and cfg.model.init_from is None:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model {cfg.model.name}'s max_seq_len="
            f"{args.max_seq_len}; lower data.seq_len or raise model.max_seq_len"
        )
    if cfg.attention.backend != "auto":  # auto resolves to a registered kernel
        get_kernel(cfg.attention.backend, cfg.attention.sdpa_kernel)
    if cfg.model.freeze and cfg.model.init_from is None:
        freeze(build_model(args), cfg.model.freeze)  # on the meta device: names only
    device = resolve_device(cfg)
    precision = precision_for(cfg, device)
    if precision.fp8 and precision.fp8_recipe == "deepseek" and cfg.model.init_from is None:
        # deepseek's 128x128 blocks refuse a shape here, before any rank starts (meta: free).
        convert_to_fp8(build_model(args), precision.fp8_recipe)

    nproc = world_size or cfg.launcher.nproc_per_node
    if device.type == "cuda" and world_size is None and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"launcher.nproc_per_node={nproc} but only {torch.cuda.device_count()} GPU(s) are "
            "visible; lower launcher.nproc_per_node or use train.device=cpu"
        )
    tp = cfg.parallelism.tp_size
    per_replica = tp * cfg.parallelism.pp_size
    if cfg.parallelism.name == "single" and nproc > per_replica:
        raise ConfigError(
            f"parallelism=single runs one process (one per tensor-parallel rank and pipeline "
            f"stage: tp_size x pp_size = {per_replica}) but {nproc} ranks were asked for; use "
            f"parallelism=fsdp or launcher.nproc_per_node={per_replica}"
        )
    if device.type == "cpu" and world_size is None:
        _check_cpu_ranks(nproc, cfg.launcher.allow_oversubscribe)
    _validate_strategy(cfg, nproc, precision, device)
    if cfg.checkpoint.resume not in ("auto", "none"):
        _check_resume_path(Path(cfg.checkpoint.resume))
    if cfg.model.init_from is not None and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(
            f"model.init_from={cfg.model.init_from} is not a directory; give a local Hugging "
            "Face checkpoint directory (config.json + weights)"
        )
    if cfg.model.init_from is not None:
        args = HFSource(cfg.model.init_from).args
        if args.vocab_size % tp:
            raise ConfigError(
                f"model.init_from's vocab_size={args.vocab_size} is not divisible by "
                f"parallelism.tp_size={tp} (padding applies to our init only); pick a tp_size "
                "dividing it"
            )
    p = cfg.parallelism
    _check_experts(args, p, cfg.optimizer.name, nproc)
    check_tensor_parallel(args, tp, cfg.data.seq_len, p.sequence_parallel)
    if tp > 1 and cfg.train.compile:
        # Tried on torch 2.13 (CPU): the whole model fails in Inductor ("Mixing fake modes"
        # at the vocab-parallel embedding), blocks compiled one by one fail in backward
        # (a redistribute handed a plain tensor). Refused before any work, not mid-run.
        raise ConfigError(
            f"train.compile=true with parallelism.tp_size={tp}: torch's compiler fails on the "
            "tensor-parallel (DTensor) model here; set train.compile=false"
        )
    if tp > 1 and kv_replicated(args.n_kv_heads, tp):
        _announce_replicated_kv(args, tp)
    _validate_pipeline(cfg, args)
    _validate_fused_loss(cfg, device)
    _validate_attention(cfg, args, precision.compute_dtype, device)
    _validate_recompute(cfg, device)


def _announce_replicated_kv(args: ModelArgs, tp: int) -> None:
    """Say which way tensor parallel places the kv heads when it cannot split them, and the
    cost: each rank holds and computes the whole wk and wv, and sums their gradients."""
    whole = 2 * args.n_layers * args.d_model * args.n_kv_heads * args.head_dim
    log.info(
        "tensor parallel replicates model.n_kv_heads=%d over parallelism.tp_size=%d: every "
        "rank holds and computes the whole wk and wv (%d parameters, %d more than 1/tp of "
        "them) and all-reduces their gradients over tp; each rank attends with one kv head",
        args.n_kv_heads,
        tp,
        whole,
        whole - whole // tp,
    )


def _validate_pipeline(cfg: Config, args: ModelArgs) -> None:
    """What pipeline parallel needs of the model, the batch and the other groups."""
    p = cfg.parallelism
    if p.pp_size == 1:
        return
    check_layout(p, args.n_layers, cfg.train.micro_batch_size)
    if cfg.attention.document_mask:
        raise ConfigError(
            f"attention.document_mask=true with parallelism.pp_size={p.pp_size}: document ids "
            "are not passed between pipeline stages; set document_mask=false or pp_size=1"
        )
    if cfg.train.compile:
        raise ConfigError(
            f"train.compile=true with parallelism.pp_size={p.pp_size}: the stage modules are "
            "not compiled here; set train.compile=false"
        )
    if OPTIMIZERS[cfg.optimizer.name].gradient_pass:
        raise ConfigError(
            f"optimizer={cfg.optimizer.name} with parallelism.pp_size={p.pp_size}: its extra "
            "gradient pass is not run through the pipeline schedule; use adamw"
        )


def _validate_fused_loss(cfg: Config, device: torch.device) -> None:
    """train.fused_loss: where the model's forward computes the loss (llm/train/loss.py)."""
    name, p = cfg.train.fused_loss, cfg.parallelism
    if name == "off":
        return
    if p.pp_size > 1:
        raise ConfigError(
            f"train.fused_loss={name} with parallelism.pp_size={p.pp_size}: the pipeline "
            "schedule computes the loss from the last stage's logits; set train.fused_loss=off"
        )
    if p.tp_size > 1:
        raise ConfigError(
            f"train.fused_loss={name} with parallelism.tp_size={p.tp_size}: tensor parallel's "
            "head leaves vocab-sharded logits to its vocab-parallel loss; set "
            "train.fused_loss=off"
        )
    if reason := fused_loss_unavailable(name, device):
        raise ConfigError(reason)


def _validate_recompute(cfg: Config, device: torch.device) -> None:
    """Policies that need something outside their own group."""
    name = cfg.recompute.name
    if name == "budget" and not cfg.train.compile:
        raise ConfigError(
            "recompute=budget is torch.compile's partitioner and needs train.compile=true; "
            "set it, or use recompute=op_sac/selective without compile"
        )
    if name == "offload" and device.type != "cuda":
        raise ConfigError(
            f"recompute=offload moves activations from the GPU to host memory; on "
            f"train.device={device.type} there is no host/device split, use recompute=none"
        )


def _validate_attention(cfg: Config, args: ModelArgs, dtype: torch.dtype, device) -> None:
    """The attention kernel (attention=auto's pick) against what it declares it supports, for
    this model, precision and device (attention sees q, k, v in the compute dtype); training
    needs its backward."""
    a = cfg.attention
    if a.document_mask and not cfg.data.packing:
        raise ConfigError(
            "attention.document_mask=true keeps packed documents apart, but data.packing=false "
            "puts one document per sample; set data.packing=true or document_mask=false"
        )
    chosen = resolve_for(a, args, device=device, dtype=dtype, seq_len=cfg.data.seq_len)
    check_kernel(
        chosen.backend,
        chosen.kernel,
        device=device.type,
        dtype=dtype,
        head_dim=args.head_dim,
        gqa=args.n_kv_heads != args.n_heads,
        dropout=args.dropout > 0,
        document_mask=a.document_mask,
        training=True,
    )


def _check_resume_path(path: Path) -> None:
    if not path.exists():
        raise ConfigError(
            f"checkpoint.resume={path} does not exist; give an existing checkpoint directory, "
            "or auto / none"
        )
    one = (path / META).is_file() or step_of(path) >= 0
    if not (one or list_checkpoints(path) or list_checkpoints(path / "checkpoints")):
        raise ConfigError(
            f"checkpoint.resume={path} holds no checkpoint; give a checkpoint folder (step_N, "
            "with meta.json), a run directory or its checkpoints/ folder, or auto / none"
        )


def _validate_strategy(cfg: Config, nproc: int, precision, device: torch.device) -> None:
    name = cfg.parallelism.name
    if cfg.optimizer.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name={cfg.optimizer.name!r} is unknown; choose one of "
            f"{', '.join(sorted(OPTIMIZERS))}"
        )
    p = cfg.parallelism
    refuse_optimizer(name, cfg.optimizer.name, p.zero_stage, p.tp_size)
    ParallelDims.from_config(p.dp_size, p.tp_size, p.pp_size, nproc)  # dp*tp*pp == world
    if p.tp_size > 1 and precision.fp8:
        raise ConfigError(
            f"precision={precision.name} with parallelism.tp_size={p.tp_size}: float8 linears "
            "are not combined with DTensor's split linears here; use precision=bf16"
        )
    if cfg.optimizer.name == "adamw8bit" and precision.update_rounding is not None:
        raise ConfigError(
            f"optimizer=adamw8bit with precision={precision.name}: its rounded update would "
            "round bitsandbytes' fp32 block scales too; use precision=bf16"
        )
    dp = nproc // (p.tp_size * p.pp_size) if p.dp_size == -1 else p.dp_size
    if name == "fsdp":
        from llm.parallel.fsdp import refuse_impossible

        refuse_impossible(cfg.parallelism.replicate, dp)
    if name == "deepspeed":  # the generated (or filled-in) ds_config, with its refusals
        from llm.parallel.ds_config import checked_ds_config

        checked_ds_config(cfg, precision, device, dp, model_args_for(cfg).d_model)
    if name == "zero3" and cfg.train.compile:
        raise ConfigError(
            "parallelism=zero3 with train.compile=true is not supported yet (its per-block "
            "hooks free and refill parameter storage; untested under compile); use "
            "train.compile=false, or parallelism=fsdp"
        )


def _check_experts(args: ModelArgs, p, optimizer: str, nproc: int) -> None:
    """MoE models and parallelism.ep_size: what runs, and one line for what does not."""
    ep = p.ep_size
    if args.moe is None:
        if ep > 1:
            raise ConfigError(
                f"parallelism.ep_size={ep} splits experts, but model {args.family} shape has "
                "none; set parallelism.ep_size=1 or use a mixture-of-experts model (model=moe-tiny)"
            )
        return
    if p.tp_size > 1 or p.pp_size > 1:
        raise ConfigError(
            f"a mixture-of-experts model with tp_size={p.tp_size}, pp_size={p.pp_size}: tensor "
            "and pipeline parallel do not split MoE blocks here; use tp_size=1 and pp_size=1"
        )
    if args.moe.n_experts % ep:
        raise ConfigError(
            f"parallelism.ep_size={ep} does not divide model.moe.n_experts="
            f"{args.moe.n_experts}; pick an ep_size that divides it"
        )
    if nproc % ep:
        raise ConfigError(
            f"parallelism.ep_size={ep} does not divide the {nproc} ranks; pick an ep_size "
            "that divides launcher.nproc_per_node"
        )
    if ep > 1 and p.name == "deepspeed":
        raise ConfigError(
            f"parallelism=deepspeed with ep_size={ep}: DeepSpeed-MoE is not a backend here; "
            "use ep_size=1"
        )
    if ep > 1 and p.name not in EP_STRATEGIES:
        raise ConfigError(
            f"parallelism={p.name} with ep_size={ep}: expert shards are held by "
            f"{', '.join(EP_STRATEGIES)} only; use one of them, or ep_size=1 (experts "
            "replicated over the data-parallel ranks)"
        )
    if ep > 1 and OPTIMIZERS[optimizer].layout != ELEMENTWISE:
        raise ConfigError(
            f"optimizer={optimizer} with ep_size={ep}: expert slices step as whole local "
            "tensors beside the strategy's shards, which only an element-wise optimizer "
            "(adamw, lion, sgd...) does alike; use one, or ep_size=1"
        )
    if ep > 1 and p.offload_optimizer:
        raise ConfigError(
            f"parallelism.offload_optimizer=true with ep_size={ep}: expert slices step on the "
            "device; set offload_optimizer=false or ep_size=1"
        )


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset, cgroups, Slurm), not the
    machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _check_cpu_ranks(nproc: int, allowed: bool) -> None:
    cores = usable_cores()
    if nproc <= cores:
        return
    if nproc > RANKS_PER_CORE_LIMIT * cores and not allowed:
        raise ConfigError(
            f"launcher.nproc_per_node={nproc} CPU ranks on {cores} usable core(s) would crawl "
            f"(each rank holds a model and they share the cores); use at most {cores} ranks, "
            "or insist with launcher.allow_oversubscribe=true"
        )
    log.warning(
        "launcher.nproc_per_node=%d CPU ranks share %d usable core(s): expect slow steps",
        nproc,
        cores,
    )
