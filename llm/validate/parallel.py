"""The cross-group checks of parallelism: the strategy against the optimizer, precision and
world size, pipeline parallel's needs of the model and batch, and expert parallel's."""

from __future__ import annotations

import logging

import torch

from llm.build import model_args_for
from llm.config import Config
from llm.errors import ConfigError
from llm.models import ModelArgs
from llm.optim import ELEMENTWISE, OPTIMIZERS
from llm.parallel.mesh import ParallelDims
from llm.parallel.pipeline import check_layout
from llm.parallel.strategy import refuse_optimizer

log = logging.getLogger(__name__)
# The strategies that hold expert slices (parallelism.ep_size > 1).
EP_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def announce_replicated_kv(args: ModelArgs, tp: int) -> None:
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


def validate_pipeline(cfg: Config, args: ModelArgs) -> None:
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


def validate_strategy(cfg: Config, nproc: int, precision, device: torch.device) -> None:
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


def check_experts(args: ModelArgs, p, optimizer: str, nproc: int) -> None:
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
    if ep > 1 and p.offload_optimizer != "none":
        raise ConfigError(
            f"parallelism.offload_optimizer={p.offload_optimizer} with ep_size={ep}: expert "
            "slices step on the device; set offload_optimizer=none or ep_size=1"
        )
