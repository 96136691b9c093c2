"""Data parallel with torch's DistributedDataParallel: a full replica per rank, gradients
all-reduced in buckets during backward (averaged over ranks), skipped inside accumulation.
With parallelism.count_comm a comm hook counts each bucket before DDP's own all-reduce;
without it DDP runs its built-in reduction untouched."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from llm.models import WeightSource, materialize_from
from llm.parallel.single import SingleStrategy
from llm.parallel.strategy import register_strategy


@register_strategy("ddp")
class DDPStrategy(SingleStrategy):
    name = "ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sent: Counter[str] = Counter()

    def wrap(self, model: torch.nn.Module, weights: WeightSource | None = None) -> torch.nn.Module:
        if weights is not None:  # a replica: the whole model on every rank
            materialize_from(model, weights, self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            find_unused_parameters=self.cfg.find_unused_parameters,
            # Gradients live inside the buckets: no second copy of every gradient.
            gradient_as_bucket_view=True,
        )
        if self.cfg.count_comm:
            ddp.register_comm_hook(self.dims.dp_group(), self._counting_allreduce)
        self.model = ddp
        return ddp

    # No `from __future__ import annotations` here: DDP checks this annotation at runtime.
    def _counting_allreduce(self, group: dist.ProcessGroup, bucket: dist.GradBucket):
        # The payload each rank hands to the all-reduce (ring traffic is 2(N-1)/N of it).
        buffer = bucket.buffer()
        self._sent["all_reduce"] += buffer.numel() * buffer.element_size()
        return default_hooks.allreduce_hook(group, bucket)

    def micro_batch(self, sync: bool):
        return super().micro_batch(sync) if sync else self.model.no_sync()

    def comm(self) -> dict[str, int]:
        sent, self._sent = dict(self._sent), Counter()
        return sent
