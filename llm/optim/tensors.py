"""What our optimizers (LAMB, Lion, Sophia) share: the local shard of a parameter, and the
params of a group that have a gradient, with their state, as flat lists for ``_foreach`` ops.

Our optimizers compute on local tensors: a DTensor's ``to_local()`` is a view of this rank's
shard, so in-place ops on it update the DTensor, and every op after that is a plain tensor
op (no DTensor dispatch per op). Only LAMB's norms span ranks, and the strategy that shards
provides them (``whole_param_squares``, llm/optim/lamb.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def with_grads(
    optimizer: torch.optim.Optimizer,
    group: dict,
    init: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    keys: tuple[str, ...],
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """(params, grads, {key: states}) of ``group``'s params that have a gradient, as local
    tensors; a param's state is made by ``init(param)`` on its first step (DTensors for
    DTensor params, which is what DCP checkpoints)."""
    params, grads, states = [], [], {k: [] for k in keys}
    for p in group["params"]:
        if p.grad is None:
            continue
        state = optimizer.state[p]
        if not state:
            state.update(init(p))
        params.append(local(p))
        grads.append(local(p.grad))
        for k in keys:
            states[k].append(local(state[k]))
    return params, grads, states
