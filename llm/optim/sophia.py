"""SophiaG (Liu et al., 2023, "Sophia: A Scalable Stochastic Second-order Optimizer for
Language Model Pre-training", Algorithm 3 with the Gauss-Newton-Bartlett estimator):

    m  <- beta1 m + (1 - beta1) g                                     every step
    every k steps (t = 1, k + 1, 2k + 1, ...), before the update:
        y_hat ~ softmax(f(w, x))  for the step's batch of B tokens
        g_hat = grad of (1/B) sum CE(f(w, x), y_hat)
        h     <- beta2 h + (1 - beta2) * B * g_hat * g_hat
    w  <- w * (1 - lr * wd)
    w  <- w - lr * clip(m / max(rho * h, eps), 1)                    element-wise clip to [-1, 1]

(The paper writes eta * clip(m / max(gamma h, eps), 1) with the clip bound rho; the official
code and this one fold those into lr and rho as above.) State: m and h, 8 bytes per fp32
element. Everything is element-wise, so it runs unchanged on shards, and in cache-sized batches of
pieces on a CPU (llm/optim/chunks.py); the estimate's extra
forward and backward is the GradientPass (llm/optim/gradient_pass.py) the strategy and the
Trainer run, whose gradients are reduced over ranks like any step's.
"""

from __future__ import annotations

import torch

from llm.optim.chunks import batch_elements, pieces
from llm.optim.gradient_pass import sampled_loss
from llm.optim.tensors import local, with_grads


def _init(p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"exp_avg": torch.zeros_like(p), "hessian": torch.zeros_like(p)}


class SophiaG(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 2e-4,
        betas=(0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 0.1,
        eps: float = 1e-15,
        hessian_every: int = 10,
    ):
        if lr <= 0 or rho <= 0 or eps <= 0 or hessian_every < 1:
            raise ValueError("SophiaG needs lr, rho, eps > 0 and hessian_every >= 1")
        defaults = {"lr": lr, "betas": tuple(betas), "rho": rho, "weight_decay": weight_decay}
        super().__init__(params, defaults | {"eps": eps})
        self.hessian_every = hessian_every
        self.gradient_pass = self  # llm/optim/gradient_pass.py's protocol, below

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, states = with_grads(self, group, _init, ("exp_avg", "hessian"))
            if not params:
                continue
            lr, wd, (beta1, _) = group["lr"], group["weight_decay"], group["betas"]
            rows = [params, grads, states["exp_avg"], states["hessian"]]
            for (p, g, m, h), _ in pieces(rows, batch_elements(params[0].device)):
                torch._foreach_mul_(m, beta1)
                torch._foreach_add_(m, g, alpha=1.0 - beta1)
                if wd:
                    torch._foreach_mul_(p, 1.0 - lr * wd)
                denom = torch._foreach_mul(h, group["rho"])
                torch._foreach_clamp_min_(denom, group["eps"])
                ratio = torch._foreach_div(m, denom)
                torch._foreach_clamp_min_(ratio, -1.0)
                torch._foreach_clamp_max_(ratio, 1.0)
                torch._foreach_add_(p, ratio, alpha=-lr)
        return loss

    # ---- the gradient pass: the Gauss-Newton-Bartlett estimate ---------------------------
    def due(self, step: int) -> bool:
        return (step - 1) % self.hessian_every == 0

    def loss(self, logits, targets, input_ids, seed: int) -> torch.Tensor:
        return sampled_loss(logits, targets, input_ids, seed)

    @torch.no_grad()
    def consume(self, tokens: torch.Tensor) -> None:
        """h <- beta2 h + (1 - beta2) B g_hat^2 for every param with a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p].update(_init(p))
            grads = [local(p.grad) for p in params]
            h = [local(self.state[p]["hessian"]) for p in params]
            beta2 = group["betas"][1]
            batch = tokens.to(device=grads[0].device, dtype=grads[0].dtype)
            torch._foreach_mul_(h, beta2)
            estimate = torch._foreach_mul(grads, grads)
            torch._foreach_mul_(estimate, batch * (1.0 - beta2))
            torch._foreach_add_(h, estimate)
