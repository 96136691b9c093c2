"""DeepSpeed's C++/CUDA ops that a run will compile on first use, said before it starts.

DeepSpeed loads an op prebuilt at install (``DS_BUILD_OPS=1``: ``installed_ops``) or else
compiles it with torch's JIT into ``TORCH_EXTENSIONS_DIR/<op>/<op>.so`` (llm.launch sets
the folder to the repository's .cache/torch_extensions), which takes minutes and prints
nothing: a first run looks hung. Which ops a run needs follows from its ds_config:

- ``deepspeed_shm_comm``: DeepSpeed's shared-memory collectives, built by
  ``deepspeed.init_distributed`` on the CPU accelerator;
- ``cpu_adam``: ZeRO-Offload's Adam (``offload_optimizer`` to cpu or nvme);
- ``async_io``: the NVMe swapper's libaio reads and writes (an ``offload_*`` to nvme);
- ``fused_adam``: Adam/AdamW without ``torch_adam`` on a GPU (our config sets torch_adam
  outside offload, a user's ds_config may not);
- ``fused_lamb``: DeepSpeed's LAMB.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHM_COMM = "deepspeed_shm_comm"


def optimizer_ops(ds_config: dict, device: torch.device) -> list[str]:
    """The ops deepspeed.initialize will load for ``ds_config``'s optimizer."""
    optimizer = ds_config.get("optimizer")
    if optimizer is None:  # a client optimizer: torch's or ours
        return []
    kind = optimizer.get("type", "").lower()
    params = optimizer.get("params", {})
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    if kind in ("adam", "adamw"):
        if offload.get("device") in ("cpu", "nvme"):  # DeepSpeed steps both on the host
            return ["cpu_adam"]
        return [] if params.get("torch_adam") or device.type != "cuda" else ["fused_adam"]
    return ["fused_lamb"] if kind == "lamb" else []


def swap_ops(ds_config: dict) -> list[str]:
    """The op DeepSpeed's NVMe swapper loads when ``ds_config`` offloads anything to nvme."""
    zero = ds_config.get("zero_optimization", {})
    sections = (zero.get("offload_optimizer") or {}, zero.get("offload_param") or {})
    return ["async_io"] if any(s.get("device") == "nvme" for s in sections) else []


def not_built(names: list[str], extensions_dir: Path | None = None) -> list[str]:
    """Those of ``names`` neither installed prebuilt nor compiled in the extensions folder
    (all that are not installed, when the folder is not known)."""
    from deepspeed.git_version_info import installed_ops

    folder = extensions_dir or _extensions_dir()
    return [
        n
        for n in names
        if not installed_ops.get(n, False)
        and (folder is None or not (folder / n / f"{n}.so").is_file())
    ]


def announce_builds(names: list[str], extensions_dir: Path | None = None) -> None:
    """Say, once (global rank 0), which ops are about to be compiled and where they go."""
    todo = not_built(names, extensions_dir)
    if not todo or (dist.is_initialized() and dist.get_rank() != 0):
        return
    folder = extensions_dir or _extensions_dir() or "torch's per-user extensions folder"
    log.warning(
        "DeepSpeed compiles its %s op%s now, on first use: several minutes with no output, "
        "once (cached in %s)",
        " and ".join(todo),
        "s" if len(todo) > 1 else "",
        folder,
    )


def _extensions_dir() -> Path | None:
    # torch's JIT builds read this variable (llm.launch.launcher.set_cache_dirs sets it);
    # without it they go to a per-user folder whose name torch composes privately.
    value = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(value) if value else None
