"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Program 1):
the update is the sign of an interpolation of momentum and gradient, so every element moves
by exactly lr; one state tensor (the momentum), 4 bytes per fp32 parameter.

    w <- w * (1 - lr * wd)
    w <- w - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

Element-wise, so it runs unchanged on any shard. The ops are ``torch._foreach_*``, as
torch's own optimizers use, over a whole param group on a GPU and over cache-sized batches
of pieces on a CPU (llm/optim/chunks.py), in lion-pytorch's order of operations so that
both give the same bits (tests/test_optim_algorithms.py).
"""

from __future__ import annotations

import torch

from llm.optim.chunks import batch_elements, pieces
from llm.optim.tensors import with_grads


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion needs lr > 0 and betas in [0, 1), got {lr}, {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, states = with_grads(
                self, group, lambda p: {"exp_avg": torch.zeros_like(p)}, ("exp_avg",)
            )
            if not params:
                continue
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            rows = [params, grads, states["exp_avg"]]
            for (p, g, m), _ in pieces(rows, batch_elements(params[0].device)):
                if wd:
                    torch._foreach_mul_(p, 1.0 - lr * wd)
                update = torch._foreach_mul(m, beta1)
                torch._foreach_add_(update, g, alpha=1.0 - beta1)
                torch._foreach_sign_(update)
                torch._foreach_add_(p, update, alpha=-lr)
                torch._foreach_mul_(m, beta2)
                torch._foreach_add_(m, g, alpha=1.0 - beta2)
        return loss
