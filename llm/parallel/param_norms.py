"""Whole-parameter norms of sharded tensors, for optimizers whose update needs them (LAMB's
trust ratio): the ``whole_param_norms`` hook our ZeRO and FSDP set on their optimizer.

Each rank holds parts of parameters (our ZeRO: flat pieces of buckets; FSDP: dim-0 rows).
Squares of the parts are summed per parameter and all-reduced once for every list asked at
once, so LAMB's norms of w and of its update cost one all-reduce of 2 x (number of
parameters) floats per step, next to the 2 x 4 x Phi bytes the gradients and weights move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def summed_norms(
    lists: list[list[torch.Tensor | None]],
    owners: list[int],
    n_params: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> list[list[torch.Tensor | None]]:
    """For lists aligned with the optimizer's tensors (param_groups order, None where one has
    no value), the L2 norm over the whole parameter ``owners[i]`` that tensor i is part of,
    summed over this rank's parts and every other rank's. Every rank must call it, also one
    that holds no part: it is a collective."""
    # On the communication device (NCCL takes no CPU tensor, an offloaded optimizer's are).
    sq = torch.zeros(len(lists), n_params, dtype=torch.float32, device=device)
    for j, tensors in enumerate(lists):
        present = [i for i, t in enumerate(tensors) if t is not None]
        if present:
            norms = torch._foreach_norm([tensors[i] for i in present], 2.0)
            squares = torch.stack([x.float().to(device) for x in norms]).pow(2)
            index = torch.tensor([owners[i] for i in present], device=device)
            sq[j].index_add_(0, index, squares)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norms = sq.sqrt()
    return [
        [None if t is None else norms[j, owners[i]].to(t.device) for i, t in enumerate(tensors)]
        for j, tensors in enumerate(lists)
    ]
