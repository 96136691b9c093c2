"""ParallelDims: the pipeline/data/tensor sizes of a run, checked once against the world size,
and the one device mesh built from them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llm.errors import ConfigError

# Outermost first, tp innermost (torchtitan's order): tensor-parallel peers are neighbouring
# ranks, r = (pp_rank * dp + dp_rank) * tp + tp_rank. Pipeline stages are the outermost
# (on a cluster: across nodes, where only one activation per micro-batch crosses).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """pp * dp * tp == world_size. ``dp_replicate`` (FSDP's HSDP replicas) splits the dp ranks
    into dp_replicate x dp_shard."""

    dp_size: int
    tp_size: int
    pp_size: int
    world_size: int
    rank: int = 0
    dp_replicate: int = 1
    device_type: str = "cpu"

    @classmethod
    def from_config(
        cls,
        dp_size: int,
        tp_size: int,
        pp_size: int,
        world_size: int,
        rank: int = 0,
        *,
        dp_replicate: int = 1,
        device_type: str = "cpu",
    ):
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
        return cls(dp_size, tp_size, pp_size, world_size, rank, dp_replicate, device_type)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp_size * self.tp_size)

    @property
    def batch_copies(self) -> int:
        """Ranks that read each dp rank's batch: its tensor-parallel peers on every pipeline
        stage (all of them count its target tokens)."""
        return self.tp_size * self.pp_size

    @property
    def loss_copies(self) -> int:
        """Ranks that hold each dp rank's loss: the tensor-parallel peers of the last pipeline
        stage (the other stages hold none)."""
        return self.tp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """The run's mesh, named by MESH_DIMS; built on first use, by every rank at once (it
        creates one process group per dimension)."""
        shard = self.dp_size // self.dp_replicate
        shape = (self.pp_size, self.dp_replicate, shard, self.tp_size)
        return init_device_mesh(self.device_type, shape, mesh_dim_names=MESH_DIMS)

    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel sub-mesh: (dp_replicate, dp_shard) under HSDP, else dp_shard."""
        return (
            self.mesh["dp_replicate", "dp_shard"]
            if self.dp_replicate > 1
            else self.mesh["dp_shard"]
        )

    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline: the stages holding the same (dp, tp) coordinate."""
        return self.pp_mesh().get_group()

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group: the world while tp = pp = 1 (no sub-mesh is
        built then), else the dp sub-mesh's group."""
        if not self.distributed:
            return None
        if self.tp_size == 1 and self.pp_size == 1:
            return dist.group.WORLD
        return self.mesh["dp_shard"].get_group()

    @functools.cached_property
    def stage_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline stage (its dp x tp ranks); the world without a
        pipeline. Collective over the world the first time (every stage builds its group)."""
        if self.pp_size == 1:
            return dist.group.WORLD
        group, _ = dist.new_subgroups_by_enumeration(
            self.mesh.mesh.reshape(self.pp_size, -1).tolist()
        )
        return group

    def new_dp_group(self) -> dist.ProcessGroup:
        """A second process group over this rank's data-parallel ranks (a channel whose
        collectives are ordered apart from ``dp_group()``'s). Collective over the world:
        every rank creates every dp group, as torch.distributed requires."""
        if self.tp_size == 1 and self.pp_size == 1:
            return dist.new_group(list(range(self.world_size)))
        # The mesh (pp, dp_replicate, dp_shard, tp): the dp_shard ranks of every other
        # coordinate, as dp_group()'s.
        shard = self.dp_size // self.dp_replicate
        ranks = self.mesh.mesh.permute(0, 1, 3, 2).reshape(-1, shard).tolist()
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        return group
