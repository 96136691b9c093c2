"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2): Adam's moments, then each parameter's update is rescaled by the
layer-wise trust ratio phi(||w||) / ||u||, so every layer moves by lr times its own norm.

    m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
    r  = m_hat / (sqrt(v_hat) + eps)        (m_hat = m / (1 - beta1^t), v_hat likewise,
                                             or m, v themselves without bias correction)
    u  = r + wd * w
    w <- w - lr * min(||w||, trust_clip) / (||u|| + eps) * u

phi clips ||w|| at ``trust_clip`` (the paper's gamma_u); a zero ||w|| or ||u|| gives ratio 1.
Groups of kind ``vector`` (biases, norm gains) are excluded from adaptation: ratio 1, a
plain Adam step, as the paper and NVIDIA's recipes do. The ``eps`` under ||u|| is
pytorch-optimizer's, kept so that both give the same numbers.

State: exp_avg and exp_avg_sq (8 bytes per fp32 element) and a 4-byte ``step`` per tensor,
as torch's AdamW. The norms are over whole parameters: ``whole_param_norms`` (set by a
strategy that shards parameters: our ZeRO for its flat pieces, FSDP for its dim-0 shards)
sums the squares of every rank's part in one all-reduce for all parameters, both norms at
once; without it the norms are local, which is right for whole tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from llm.optim.tensors import with_grads

# whole_param_norms(lists): each list aligned with the optimizer's params (in param_groups
# order, None where a param has no gradient); returns each list's whole-parameter L2 norms.
NormHook = Callable[[list[list[torch.Tensor | None]]], list[list[torch.Tensor | None]]]


def local_norms(lists: list[list[torch.Tensor | None]]) -> list[list[torch.Tensor | None]]:
    out = []
    for tensors in lists:
        present = [t for t in tensors if t is not None]
        norms = iter(torch._foreach_norm(present, 2.0)) if present else iter(())
        out.append([None if t is None else next(norms) for t in tensors])
    return out


def _init(p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }


class Lamb(torch.optim.Optimizer):
    whole_param_norms: NormHook | None = None

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        trust_clip: float = 10.0,
    ):
        if lr <= 0 or eps <= 0 or trust_clip <= 0:
            raise ValueError(f"LAMB needs lr, eps, trust_clip > 0, got {lr}, {eps}, {trust_clip}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "trust_clip": trust_clip,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Pass 1: Adam's direction u per parameter, every group; pass 2: one call for the
        # norms of w and u over all parameters (one all-reduce when sharded); pass 3: apply.
        work = []  # (group, params, updates, position in the flat param list)
        positions, flat_index = [], 0
        for group in self.param_groups:
            params, updates, where = self._directions(group, flat_index)
            flat_index += len(group["params"])
            work.append((group, params, updates))
            positions.append(where)
        weights: list[torch.Tensor | None] = [None] * flat_index
        directions: list[torch.Tensor | None] = [None] * flat_index
        for (_, params, updates), where in zip(work, positions, strict=True):
            for i, p, u in zip(where, params, updates, strict=True):
                weights[i], directions[i] = p, u
        hook = self.whole_param_norms or local_norms
        w_norms, u_norms = hook([weights, directions])
        for (group, params, updates), where in zip(work, positions, strict=True):
            if not params:
                continue
            if group.get("kind", "matrix") != "vector":
                ratios = _trust_ratios(
                    torch.stack([w_norms[i] for i in where]),
                    torch.stack([u_norms[i] for i in where]),
                    group["trust_clip"],
                    group["eps"],
                )
                torch._foreach_mul_(updates, ratios.to(updates[0].dtype).unbind())
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return loss

    def _directions(self, group: dict, first: int):
        """u = Adam's direction + wd * w for ``group``'s params with a gradient, and their
        positions in the flat list of the optimizer's params."""
        params, grads, states = with_grads(self, group, _init, ("step", "exp_avg", "exp_avg_sq"))
        where = [first + i for i, p in enumerate(group["params"]) if p.grad is not None]
        if not params:
            return [], [], []
        beta1, beta2 = group["betas"]
        m, v, steps = states["exp_avg"], states["exp_avg_sq"], states["step"]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(v)
        if group["bias_correction"]:
            t = steps[0].item()  # a CPU scalar, as torch's Adam keeps it: no device sync
            torch._foreach_div_(denom, math.sqrt(1.0 - beta2**t))
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_mul_(denom, 1.0 - beta1**t)
        else:
            torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(m, denom)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return params, updates, where


def _trust_ratios(w_norms, u_norms, clip: float, eps: float) -> torch.Tensor:
    """One trust ratio per parameter of a group, computed on stacked norms (a handful of ops
    per group rather than per parameter)."""
    w_norms = w_norms.clamp(max=clip)
    return torch.where((w_norms > 0) & (u_norms > 0), w_norms / (u_norms + eps), 1.0)
