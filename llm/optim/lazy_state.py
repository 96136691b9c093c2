"""Creating an optimizer's lazily made state, so that a checkpoint can be loaded into it."""

from __future__ import annotations

import torch


@torch.no_grad()
def materialize_state(optimizer: torch.optim.Optimizer, params: list[tuple[torch.Tensor, int]]):
    """Give each ``(tensor, param-group index)`` its state (Adam's moments exist only after a
    first step) as torch DCP does: one step at lr 0 on zero gradients, weights unchanged (the
    step count it sets is overwritten by the load). Only ``params`` take part, so a caller
    that passes one bucket at a time bounds the step's temporaries by that bucket.

    An optimizer with ``make_state(tensor, group_index)`` makes it that way instead: one whose
    sharded step is a collective (Muon, Adafactor) must not step on one rank alone."""
    make_state = getattr(optimizer, "make_state", None)
    if make_state is not None:
        for tensor, gi in params:
            make_state(tensor, gi)
        return
    saved = [(g["params"], g["lr"]) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"], g["lr"] = [], 0.0
    for tensor, gi in params:
        optimizer.param_groups[gi]["params"].append(tensor)
    grads = [tensor.grad for tensor, _ in params]
    for tensor, _ in params:
        tensor.grad = torch.zeros_like(tensor)
    try:
        optimizer.step()
    finally:
        for (tensor, _), grad in zip(params, grads, strict=True):
            tensor.grad = grad
        for g, (group_params, lr) in zip(optimizer.param_groups, saved, strict=True):
            g["params"], g["lr"] = group_params, lr
