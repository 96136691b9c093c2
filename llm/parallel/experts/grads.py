"""Gradient reduction of the expert parameters: over the edp ranks that hold the same
experts, not the whole data-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llm.parallel.experts.shards import ExpertShards


@torch.no_grad()
def reduce_expert_grads(shards: ExpertShards, count: bool = False) -> None:
    """Divide each expert gradient by the dp size, as every other gradient is averaged, and
    sum it over its edp group; with ``count``, the all-reduces' payload goes to
    ``shards.sent``."""
    for param in shards.params.values():
        if param.grad is None:
            continue
        param.grad.div_(shards.dp_size)
        if shards.edp > 1:
            dist.all_reduce(param.grad, group=shards.edp_group)
            if count:
                shards.sent.add("all_reduce", param.grad)
