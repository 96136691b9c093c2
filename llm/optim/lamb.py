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
as torch's AdamW. The step runs in two passes over cache-sized batches of pieces
(llm/optim/chunks.py): the first updates the moments and sums, per parameter, the squares
of w and of its direction u; the second computes u again from the new moments (cheaper on a
CPU than keeping a model-sized u) and applies it scaled by the trust ratio. The norms are
over whole parameters: ``whole_param_squares`` (set by a strategy that shards parameters:
our ZeRO for its flat pieces, FSDP for its dim-0 shards) sums every rank's squares per
parameter in one all-reduce, both norms at once; without it the sums are local, which is
right for whole tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm.optim.chunks import batch_elements, pieces
from llm.optim.tensors import with_grads

# whole_param_squares(squares): squares[k, i] is this rank's sum of squares of the
# optimizer's tensor i (in param_groups order) for quantity k (0: w, 1: u); returns the
# same shape, each entry summed over every rank's part of tensor i's parameter.
SquaresHook = Callable[[torch.Tensor], torch.Tensor]


def _init(p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }


class Lamb(torch.optim.Optimizer):
    whole_param_squares: SquaresHook | None = None

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
        total = sum(len(g["params"]) for g in self.param_groups)
        device = next(p.device for g in self.param_groups for p in g["params"])
        squares, adapted, first = torch.zeros(2, total, device=device), [], 0
        for group in self.param_groups:
            params, grads, states = with_grads(
                self, group, _init, ("step", "exp_avg", "exp_avg_sq")
            )
            where = [first + i for i, p in enumerate(group["params"]) if p.grad is not None]
            first += len(group["params"])
            if not params:
                continue
            torch._foreach_add_(states["step"], 1.0)
            # The counters stay on the host as torch's Adam keeps them; their value goes to
            # the device (a copy there, which waits for nothing), not to Python.
            t = states["step"][0].to(params[0].device, torch.float64, non_blocking=True)
            rows = [params, grads, states["exp_avg"], states["exp_avg_sq"]]
            limit = batch_elements(params[0].device)
            scale, eps = _bias_correction(group, t)
            adapt = group.get("kind", "matrix") != "vector"
            for (p, g, m, v), owners in pieces(rows, limit):
                _update_moments(m, v, g, group["betas"])
                denom = _denominator(v, eps)
                if not adapt:  # biases and norm gains: a plain Adam step, no second pass
                    if group["weight_decay"]:
                        torch._foreach_mul_(p, 1.0 - group["lr"] * group["weight_decay"])
                    torch._foreach_add_(p, _adam_direction(m, denom, -group["lr"] * scale))
                    continue
                u = torch._foreach_mul(p, group["weight_decay"])
                torch._foreach_add_(u, _adam_direction(m, denom, scale))
                norms = torch.stack(torch._foreach_norm([*p, *u], 2.0)).view(2, len(p))
                index = torch.tensor([where[o] for o in owners], device=squares.device)
                squares.index_add_(1, index, norms.float().pow(2))
            if adapt:
                adapted.append((group, rows, where, scale, eps, limit))
        # Always, even with nothing adapted here: the hook is a collective every rank joins.
        if self.whole_param_squares is not None:
            squares = self.whole_param_squares(squares)
        w_norms, u_norms = squares.sqrt()
        # Pass 2: w <- w - lr * ratio * (wd * w + scale * m / denom), as one multiply of w
        # and one multiply-add per piece, with the ratio folded into per-tensor factors that
        # stay on the device (0-d tensors: no host read).
        for group, rows, where, scale, eps, limit in adapted:
            lr, wd = group["lr"], group["weight_decay"]
            ratios = _trust_ratios(
                w_norms[where], u_norms[where], group["trust_clip"], group["eps"]
            )
            for (p, _, m, v), owners in pieces(rows, limit):
                ratio = ratios[torch.tensor(owners, device=ratios.device)]
                denom = _denominator(v, eps)
                if wd:
                    torch._foreach_mul_(p, list((1.0 - lr * wd * ratio).unbind()))
                torch._foreach_add_(
                    p, _adam_direction(m, denom, list((-lr * scale * ratio).unbind()))
                )
        return loss


def _adam_direction(m, denom, factor) -> list[torch.Tensor]:
    """``factor * m / denom`` per tensor; ``factor`` a number or a device tensor, or one
    0-d tensor per tensor (a device scalar cannot be an addcdiv's ``value``)."""
    out = torch._foreach_div(m, denom)
    torch._foreach_mul_(out, factor)
    return out


def _update_moments(m, v, g, betas) -> None:
    beta1, beta2 = betas
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)


def _bias_correction(
    group: dict, t: torch.Tensor
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(scale, eps') with m_hat / (sqrt(v_hat) + eps) = scale * m / (sqrt(v) + eps'): the
    corrections folded into two scalars, so that no op runs over the tensors for them;
    0-d fp32 tensors on the device, from the step count ``t`` (fp64 there)."""
    if not group["bias_correction"]:
        return 1.0, group["eps"]
    beta1, beta2 = group["betas"]
    root = (1.0 - torch.pow(beta2, t)).sqrt()
    return (root / (1.0 - torch.pow(beta1, t))).float(), (group["eps"] * root).float()


def _denominator(v, eps: float) -> list[torch.Tensor]:
    denom = torch._foreach_sqrt(v)
    torch._foreach_add_(denom, eps)
    return denom


def _trust_ratios(w_norms, u_norms, clip: float, eps: float) -> torch.Tensor:
    """One trust ratio per parameter of a group, computed on stacked norms (a handful of ops
    per group rather than per parameter)."""
    w_norms = w_norms.clamp(max=clip)
    return torch.where((w_norms > 0) & (u_norms > 0), w_norms / (u_norms + eps), 1.0)
