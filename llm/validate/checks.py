"""Cross-group checks on a whole Config, run once before any rank starts: :func:`validate`
runs them all (parallelism's in parallel.py, the attention kernel's, fused loss's and
recompute's in compute.py) and holds those of the model, device, ranks and paths.

Each failure is a ConfigError with one line naming the problem and the fix; single-group
checks live in the dataclasses' ``__post_init__`` (llm/config/).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from llm.attention import get_kernel
from llm.build import model_args_for, resolve_device, tokenizer_vocab_size
from llm.config import Config
from llm.errors import ConfigError
from llm.models import HFSource, ModelArgs, build_model, freeze
from llm.parallel.binding import rank_device
from llm.parallel.dist import RankEnv
from llm.parallel.tensor_parallel import check_tensor_parallel, kv_replicated
from llm.precision import precision_for
from llm.precision.fp8 import convert_to_fp8
from llm.train.checkpoint_files import META, list_checkpoints, step_of
from llm.validate.compute import validate_attention, validate_fused_loss, validate_recompute
from llm.validate.offload import validate_offload
from llm.validate.parallel import (
    announce_replicated_kv,
    check_experts,
    validate_pipeline,
    validate_strategy,
)

log = logging.getLogger(__name__)
# Local CPU ranks per usable core beyond which a run is refused without
# launcher.allow_oversubscribe=true: 64 ranks on 2 cores took 4 minutes to step 1 and 16 GB.
RANKS_PER_CORE_LIMIT = 4


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


def validate(cfg: Config, world_size: int | None = None, rank_env: RankEnv | None = None) -> None:
    """Refuse impossible combinations. ``world_size`` is known under torchrun/Slurm, and
    ``rank_env`` is this process's rank there (its GPU binding is checked)."""
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

    if cfg.train.allocator_blocks and device.type != "cuda":
        raise ConfigError(
            f"train.allocator_blocks={cfg.train.allocator_blocks} reads the CUDA allocator's "
            f"record and this run is on {device.type}; use train.peak_tensors=N (the live "
            "tensors, any device) or run on a GPU"
        )
    nproc = world_size or cfg.launcher.nproc_per_node
    if device.type == "cuda" and world_size is None and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"launcher.nproc_per_node={nproc} but only {torch.cuda.device_count()} GPU(s) are "
            "visible; lower launcher.nproc_per_node or use train.device=cpu"
        )
    if device.type == "cuda" and rank_env is not None:
        rank_device(rank_env, torch.cuda.device_count())  # an outside launcher's binding
    tp = cfg.parallelism.tp_size
    per_replica = tp * cfg.parallelism.pp_size
    if cfg.parallelism.name == "single" and nproc > per_replica:
        raise ConfigError(
            f"parallelism=single runs one process (one per tensor-parallel rank and pipeline "
            f"stage: tp_size x pp_size = {per_replica}) but {nproc} ranks were asked for; use "
            f"parallelism=fsdp or launcher.nproc_per_node={per_replica}"
        )
    if device.type == "cpu" and world_size is None:
        check_cpu_ranks(nproc, cfg.launcher.allow_oversubscribe)
    validate_strategy(cfg, nproc, precision, device)
    validate_offload(cfg, args, precision, cfg.launcher.nproc_per_node, nproc)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_resume_path(Path(cfg.checkpoint.resume))
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
        if args.moe is not None:
            log.info(
                "model.init_from is a Mixtral checkpoint: its balance loss is transformers' "
                "(model.moe.balance_loss=pooled: one loss over every layer's router rows, "
                "top_k at perfect balance) weighted by its router_aux_loss_coef=%g",
                args.moe.aux_loss_coef,
            )
    p = cfg.parallelism
    check_experts(args, p, cfg.optimizer.name, nproc)
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
        announce_replicated_kv(args, tp)
    validate_pipeline(cfg, args)
    validate_fused_loss(cfg, device)
    validate_attention(cfg, args, precision.compute_dtype, device)
    validate_recompute(cfg, device)


def check_resume_path(path: Path) -> None:
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


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset, cgroups, Slurm), not the
    machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_ranks(nproc: int, allowed: bool) -> None:
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
