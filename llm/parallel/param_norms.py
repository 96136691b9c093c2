"""Whole-parameter sums of squares of sharded tensors, for optimizers whose update needs
norms over whole parameters (LAMB's trust ratio): the ``whole_param_squares`` hook our ZeRO
and FSDP set on their optimizer.

Each rank holds parts of parameters (our ZeRO: flat pieces of buckets; FSDP: dim-0 rows).
The optimizer sums the squares of its parts; this sums them per parameter and all-reduces
once for every quantity asked at once, so LAMB's norms of w and of its update cost one
all-reduce of 2 x (number of parameters) floats per step, next to the 2 x 4 x Phi bytes the
gradients and weights move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def summed_squares(
    squares: torch.Tensor,
    owners: list[int],
    n_params: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``squares[k, i]``: this rank's sum of squares of the optimizer's tensor i (param_groups
    order) for quantity k. Returns the same shape, entry (k, i) summed over every part, on
    every rank, of parameter ``owners[i]``. Every rank must call it, also one that holds no
    part: it is a collective."""
    # On the communication device (NCCL takes no CPU tensor, an offloaded optimizer's are).
    index = torch.tensor(owners, device=device)
    per_param = torch.zeros(squares.shape[0], n_params, dtype=torch.float32, device=device)
    per_param.index_add_(1, index, squares.to(device=device, dtype=torch.float32))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(per_param, group=group)
    return per_param[:, index].to(squares.device)
