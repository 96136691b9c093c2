"""One rank's view of the world: who it is (RankEnv), joining the process group, and the
small object collectives the run and the strategies share. The environment is read by
llm.launch.launcher, which hands a RankEnv here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # "env://" under torchrun / deepspeed: their agent may already host the rendezvous store
    # on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), which a tcp:// init would collide with.
    init_method: str | None = None
    # Ranks on this node (torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE,
    # Slurm's tasks on this node, or ours); None where the launcher does not say.
    local_world_size: int | None = None
    # The variables that decided this rank's GPU, as (name, value), for a refusal to show
    # (llm.parallel.binding): CUDA_VISIBLE_DEVICES, SLURM_LOCALID, LOCAL_RANK.
    binding_vars: tuple[tuple[str, str], ...] = ()
    # Where NCCL's flight recorder dumps this rank's last collectives on a timeout
    # (TORCH_FR_DUMP_TEMP_FILE, to which torch appends the rank; llm.parallel.hangs).
    trace_prefix: str | None = None

    @property
    def init_url(self) -> str:
        return self.init_method or f"tcp://{self.master_addr}:{self.master_port}"


def init_distributed(
    env: RankEnv, device: torch.device, backend: str, needed: bool, timeout_min: float = 10.0
) -> None:
    """Join the process group (nccl on GPU, gloo on CPU for backend="auto"); a collective
    that waits ``timeout_min`` minutes for its peers times out (launcher.timeout_min)."""
    if not needed or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=env.init_url,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=timeout_min),
    )


def is_multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rehearsing() -> bool:
    """Whether this process rehearses one rank over torch's fake process group
    (llm.rehearse): collectives return at once and carry no other rank's data."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def gather_object(value, group: dist.ProcessGroup | None = None) -> list:
    """``value`` from every rank of ``group``, in rank order (just [value] alone). In a
    rehearsal every rank is taken to hold this rank's value: the fake group's object
    gathers carry nothing from other ranks."""
    if rehearsing():
        return [value] * dist.get_world_size(group)
    if not is_multi_rank():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
