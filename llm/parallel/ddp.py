"""Data parallel with torch's DistributedDataParallel: a full replica per rank, gradients
all-reduced in buckets during backward (averaged over ranks), skipped inside accumulation.
Its comm hook reduces each bucket in the policy's ``reduce_dtype``, divided by the dp size
before the all-reduce (fp16 headroom), as every strategy does, and with
parallelism.count_comm counts each bucket's payload."""

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from llm.comm.sent import CommCounter
from llm.models import WeightSource, materialize_from
from llm.parallel.single import SingleStrategy
from llm.parallel.strategy import register_strategy


@register_strategy("ddp")
def ddp_strategy(cfg, dims, *args, **kwargs) -> SingleStrategy:
    """torch's DDP; with tensor or pipeline parallel, torch's FSDP2-style replicate
    (ddp_replicate.py)."""
    if dims.tp_size > 1 or dims.pp_size > 1:
        from llm.parallel.ddp_replicate import ReplicateDDP

        return ReplicateDDP(cfg, dims, *args, **kwargs)
    return DDPStrategy(cfg, dims, *args, **kwargs)


class DDPStrategy(SingleStrategy):
    name = "ddp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sent = CommCounter()

    def wrap(self, model: torch.nn.Module, weights: WeightSource | None = None) -> torch.nn.Module:
        if weights is not None:  # a replica: the whole model on every rank
            materialize_from(model, weights, self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        if self.expert_shards:  # differ between ep ranks: reduced over their edp ranks instead
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, list(self.expert_shards.params)
            )
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            find_unused_parameters=self.cfg.find_unused_parameters,
            # Gradients live inside the buckets: no second copy of every gradient.
            gradient_as_bucket_view=True,
        )
        ddp.register_comm_hook(self.dims.dp_group(), self._reduce_bucket)
        self.model = ddp
        return ddp

    @property
    def grads_same_on_every_rank(self) -> bool:
        """After DDP's all-reduce every rank holds the same averaged gradients, so each
        rank's norm is already the global one; expert slices differ between ep ranks."""
        return not self.expert_shards

    # No `from __future__ import annotations` here: DDP checks this annotation at runtime.
    def _reduce_bucket(self, group: dist.ProcessGroup, bucket: dist.GradBucket):
        buffer = bucket.buffer()
        # A copy in the reduce dtype only when it differs from the gradients' (DDP's own
        # hooks divide in place too: the bucket is overwritten by the result anyway).
        payload = buffer.to(self.precision.reduce_dtype)
        payload.div_(dist.get_world_size(group))
        if self.counting:
            # The payload each rank hands to the all-reduce (ring traffic is 2(N-1)/N of it).
            self._sent.add("all_reduce", payload)
        fut = dist.all_reduce(payload, group=group, async_op=True).get_future()
        # The all-reduce works in place, so the result is the payload itself (read from it,
        # not from the future: the fake process group of llm.rehearse completes with None).
        if payload is buffer:
            return fut.then(lambda _: buffer)
        return fut.then(lambda _: buffer.copy_(payload))

    @contextlib.contextmanager
    def micro_batch(self, sync: bool):
        ddp = super().micro_batch(sync) if sync else self.model.no_sync()
        with ddp, self.expert_micro_batch(sync):
            yield

    def take_sent(self) -> dict[str, int]:
        sent = Counter(self._sent.take_sent())
        if self.expert_shards:
            sent.update(self.expert_shards.sent.take_sent())
        return dict(sent)
