"""The machine a plan is for: nodes of GPUs, their memory, sustained FLOP/s, and two link
speeds (estimate.* in llm.config.EstimateConfig): NVLink inside a node, InfiniBand between
nodes. Ranks are laid out tp innermost, then dp, then pp (llm.parallel.mesh), so a group
stays on one node when the ranks it spans fit in one."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config import Config
from llm.estimate.device_profile import DeviceProfile, resolve

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    device_memory: int  # bytes per GPU
    flops_per_s: float  # sustained matmul FLOP/s per GPU
    intra_node: float  # bytes/s per GPU on NVLink
    inter_node: float  # bytes/s per GPU on InfiniBand
    # estimate.device's measured rates; None: every matmul at flops_per_s.
    profile: DeviceProfile | None = None
    host_memory: int = 2048 * GIB  # bytes per node, for offload to cpu
    nvme: float = 25e9  # bytes/s per node each way, for offload to nvme

    @classmethod
    def from_config(cls, cfg: Config) -> Cluster:
        e = cfg.estimate
        return cls(
            nodes=e.nodes,
            gpus_per_node=e.gpus_per_node or cfg.launcher.nproc_per_node,
            device_memory=int(e.device_memory_gb * GIB),
            flops_per_s=e.flops_per_s,
            intra_node=e.intra_node_gb_s * 1e9,
            inter_node=e.inter_node_gb_s * 1e9,
            profile=resolve(e.device),
            host_memory=int(e.host_memory_gb * GIB),
            nvme=e.nvme_gb_s * 1e9,
        )

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def bandwidth(self, span: int) -> float:
        """Per-GPU link speed of a group whose ranks span ``span`` consecutive ranks."""
        return self.intra_node if span <= self.gpus_per_node else self.inter_node


def ring_seconds(payload: float, ranks: int, bandwidth: float, phases: int) -> float:
    """A ring collective over ``ranks``: each phase (reduce-scatter or all-gather) moves
    (N - 1)/N of the payload through every rank's link; an all-reduce is two phases."""
    if ranks == 1:
        return 0.0
    return phases * (ranks - 1) / ranks * payload / bandwidth
