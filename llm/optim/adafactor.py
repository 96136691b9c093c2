"""Adafactor (Shazeer & Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear
Memory Cost", Algorithms 4 and 5, no first moment), in torch.optim.Adafactor's form:

    t <- t + 1;  beta2_t = 1 - t^beta2_decay;  rho_t = min(lr, 1 / sqrt(t))
    alpha_t = max(eps2, RMS(w)) * rho_t                      (relative step size)
    w <- w * (1 - lr * wd)                                   (decoupled decay, torch's)
    matrix (last two dims n x m):
        R <- beta2_t R + (1 - beta2_t) mean_cols(g^2)        (n x 1)
        C <- beta2_t C + (1 - beta2_t) mean_rows(g^2)        (1 x m)
        V  = R C / max(mean(R), eps1)
    vector: V <- beta2_t V + (1 - beta2_t) g^2
    U  = g / sqrt(max(V, eps1^2))
    w <- w - alpha_t / max(1, RMS(U) / d) * U                (update clipping)

State: a row and a column vector per matrix (the factored second moment, n + m elements
instead of n m), a full vector for 1-D parameters, and a 4-byte ``step``; no momentum.

Ours, as LAMB is, because every reduction above is over a whole parameter (the row and
column means, RMS(w), RMS(U)) and torch's step computes them inside, where a sharded
strategy cannot insert a collective. On whole tensors it follows torch's single-tensor step
operation for operation, except that its step-size scalars are computed on the device (no
host read per parameter), so the two agree to fp32 rounding, as transformers' ``Adafactor``
with the same settings does (tests/test_adafactor.py). With a
``shard_layout`` (our ZeRO's flat pieces, FSDP's rows) the step is
llm/optim/adafactor_sharded.py's: the same arithmetic, its reductions summed over ranks.
"""

from __future__ import annotations

import torch

from llm.optim.adafactor_sharded import sharded_step, step_scalars
from llm.optim.shard_layout import ShardLayout


class Adafactor(torch.optim.Optimizer):
    shard_layout: ShardLayout | None = None

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
    ):
        if lr <= 0 or beta2_decay > 0 or d <= 0:
            raise ValueError(
                f"Adafactor needs lr > 0, beta2_decay <= 0 and d > 0, got {lr}, {beta2_decay}, {d}"
            )
        defaults = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": tuple(eps),
            "d": d,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    def make_state(self, p: torch.Tensor, group_index: int = 0) -> dict:
        """The factored statistics have the whole parameter's shape (under a shard layout
        every rank holding a piece keeps them whole: n + m elements per matrix); a vector's
        variance is element-wise, the piece's own."""
        state = self.state[p]
        if not state:
            shape = (
                self.shard_layout.parameter_of(p)[1].shape if self.shard_layout else tuple(p.shape)
            )
            state["step"] = torch.tensor(0.0)
            if len(shape) > 1:
                local = p.to_local() if hasattr(p, "to_local") else p
                state["row_var"] = local.new_zeros(shape[:-1]).unsqueeze(-1)
                state["col_var"] = local.new_zeros(shape[:-2] + shape[-1:]).unsqueeze(-2)
            else:
                state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.shard_layout is not None:
            sharded_step(self, self.shard_layout)
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, self.make_state(p), group)
        return loss

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, wd, d = group["lr"], group["weight_decay"], group["d"]
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(p.dtype).eps
        state["step"] += 1
        beta, rho = step_scalars(state["step"], group, p.device)
        one_minus_beta2_t = beta.to(p.dtype)
        alpha = (p.norm(2).double() / (p.numel() ** 0.5)).clamp(min=eps2) * rho
        if wd != 0:
            p.mul_(1 - lr * wd)
        if grad.dim() > 1:
            row_var, col_var = state["row_var"], state["col_var"]
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance = state["variance"]
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = (update.norm(2).double() / ((update.numel() ** 0.5) * d)).clamp(min=1.0)
        p.add_(update.mul_((-alpha / denom).to(update.dtype)))
