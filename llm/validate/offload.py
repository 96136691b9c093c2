"""The cross-group checks of offloading to nvme (parallelism.offload_optimizer=nvme,
offload_params=nvme under zero3): what the streamed step can run exactly, and a folder
that exists, takes files and has room for every rank of this host, all before any rank
starts. DeepSpeed's own NVMe offload checks its folder itself."""

from __future__ import annotations

from llm.config import Config
from llm.errors import ConfigError
from llm.models import build_model
from llm.optim import ELEMENTWISE, OPTIMIZERS
from llm.parallel.zero.nvme import check_nvme_path


def offloaded_bytes_per_rank(cfg: Config, args, precision, world: int) -> int:
    """What one rank's files hold: for the optimizer the master and the optimizer's state
    (12 bytes per parameter for AdamW), for stage-3 parameters the working shard, each
    over the world (dp shards it, tp and pp split it)."""
    p = cfg.parallelism
    n = sum(x.numel() for x in build_model(args).parameters())  # the meta device: free
    per_param = 0.0
    if p.offload_optimizer == "nvme":
        opt = OPTIMIZERS[cfg.optimizer.name]
        per_param += precision.master_dtype.itemsize
        per_param += opt.state_bytes((n,), "matrix", cfg.optimizer) / max(1, n)
    if p.offload_params == "nvme":
        per_param += precision.working_dtype.itemsize
    return int(per_param * n / world)


def validate_offload(cfg: Config, args, precision, nproc: int, world: int) -> None:
    p = cfg.parallelism
    if "nvme" not in (p.offload_optimizer, p.offload_params):
        return
    if p.name == "deepspeed":
        _refuse_deepspeed_nvme_checkpoints(cfg)
        return
    spec = OPTIMIZERS[cfg.optimizer.name]
    if p.offload_optimizer == "nvme" and (spec.layout != ELEMENTWISE or spec.gradient_pass):
        raise ConfigError(
            f"parallelism.offload_optimizer=nvme with optimizer={cfg.optimizer.name}: the "
            "streamed step runs element-wise optimizers one bucket at a time (adamw, sgd, "
            "lion); use one of them or offload_optimizer=cpu"
        )
    if precision.update_rounding is not None:
        raise ConfigError(
            f"parallelism.offload_*=nvme with precision={precision.name}: its rounded update "
            "keeps state beside the optimizer's that is not streamed; use precision=bf16"
        )
    need = offloaded_bytes_per_rank(cfg, args, precision, world) * nproc
    check_nvme_path(p.nvme_path, need)


def _refuse_deepspeed_nvme_checkpoints(cfg: Config) -> None:
    """Our DeepSpeed checkpoint code (llm/parallel/ds_checkpoint.py) reads the engine's fp32
    optimizer partitions in memory; DeepSpeed's NVMe offload leaves a swapped partition
    empty there, so every rank's first save would fail mid-run ("start (0) + length (N)
    exceeds dimension size (0)"). Refused before the run instead."""
    if cfg.parallelism.offload_optimizer == "nvme" and cfg.checkpoint.enabled:
        raise ConfigError(
            "parallelism=deepspeed with offload_optimizer=nvme: our checkpoints read "
            "DeepSpeed's fp32 optimizer partitions in memory, which its NVMe swap leaves "
            "empty; set checkpoint.enabled=false, or use offload_optimizer=cpu or our "
            "parallelism=zero3 with offload_optimizer=nvme"
        )
