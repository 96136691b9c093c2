"""``estimate.*``: ``python -m llm.estimate``'s options."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError


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
    # The plan's offload tiers (a layout too big for the devices whose ZeRO can offload):
    # host memory per node, and the node's NVMe read or write speed (each direction, all its
    # drives together; ZeRO-Infinity's DGX-2 had 25 GB/s over 16 drives).
    host_memory_gb: float = 2048.0
    nvme_gb_s: float = 25.0
    # The plan's global batch in sequences per step; None: train.micro_batch_size x
    # train.grad_accum_steps x every device.
    global_batch: int | None = None
    plan_rows: int = 20  # layouts the plan's table prints (estimate.json gets all)

    def __post_init__(self) -> None:
        require_choice("estimate", "mode", self.mode, ("train", "inference"))
        require_positive("estimate", batch=self.batch, context=self.context)
        if self.mode == "train" and (self.batch, self.context) != (None, None):
            raise ConfigError(
                "estimate.batch and estimate.context size an inference estimate; add "
                "estimate.mode=inference, or drop them (training uses train.micro_batch_size "
                "and data.seq_len)"
            )
        require_positive(
            "estimate",
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            device_memory_gb=self.device_memory_gb,
            num_params=self.num_params,
            flops_per_s=self.flops_per_s,
            intra_node_gb_s=self.intra_node_gb_s,
            inter_node_gb_s=self.inter_node_gb_s,
            host_memory_gb=self.host_memory_gb,
            nvme_gb_s=self.nvme_gb_s,
            global_batch=self.global_batch,
            plan_rows=self.plan_rows,
        )
        if self.rank < 0:
            raise ConfigError(f"estimate.rank={self.rank} must be >= 0")

    @property
    def kernels(self) -> str:
        """The device whose kernels the estimate sizes: cpu, or cuda for every GPU."""
        return "cpu" if self.device == "cpu" else "cuda"
