"""ParallelDims: the data/tensor/pipeline sizes of a run, checked once against the world size."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from llm.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """dp * tp * pp == world_size; ranks are laid out dp-major (as torchtitan's mesh)."""

    dp_size: int
    tp_size: int
    pp_size: int
    world_size: int
    rank: int = 0

    @classmethod
    def from_config(cls, dp_size: int, tp_size: int, pp_size: int, world_size: int, rank: int = 0):
        if dp_size == -1:
            if world_size % (tp_size * pp_size):
                raise ConfigError(
                    f"world size {world_size} is not divisible by tp_size*pp_size="
                    f"{tp_size * pp_size}; change launcher.nproc_per_node or the parallel sizes"
                )
            dp_size = world_size // (tp_size * pp_size)
        if dp_size * tp_size * pp_size != world_size:
            raise ConfigError(
                f"dp_size*tp_size*pp_size = {dp_size}*{tp_size}*{pp_size} != world size "
                f"{world_size}; set parallelism.dp_size=-1 or match launcher.nproc_per_node"
            )
        return cls(dp_size, tp_size, pp_size, world_size, rank)

    @property
    def dp_rank(self) -> int:
        # With tp = pp = 1 (all that exists so far) the dp rank is the global rank.
        return self.rank // (self.tp_size * self.pp_size)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (the default group while tp = pp = 1)."""
        return dist.group.WORLD if self.distributed else None
