"""Adafactor's step over sharded parameters (llm/optim/adafactor.py has the algorithm).

Each rank holds flat pieces of parameters (a ``ShardLayout``). Every quantity the update
needs of a whole parameter is a sum, so each rank sums over its piece and one all-reduce
adds the ranks' sums:
1. per matrix, the row and column sums of g^2 (n + m floats; a piece adds into the rows and
   columns its elements fall in), and per parameter the sum of w^2 for RMS(w): one
   all-reduce of one buffer laid out by parameter, the same on every rank;
2. per parameter, the sum of U^2 for the update clipping: a second all-reduce of one float
   per parameter, since U needs the statistics of step 1.
Each rank keeps every matrix it holds a piece of factored whole (row and column vectors,
n + m elements), so the statistics are updated identically on those ranks; a vector's
variance is element-wise and stays sharded. Between the two all-reduces the update U of
every piece is held at once: a temporary the size of the rank's pieces (the gradient's).
The sums run in another order than a whole tensor's, so the result equals one process's to
fp32 rounding, not bit for bit (tests/test_optim_strategies.py).
"""

from __future__ import annotations

import torch

from llm.optim.shard_layout import ParamLayout, ShardLayout
from llm.optim.tensors import local


def _segments(layout: ShardLayout) -> tuple[list[tuple[int, int, int]], int]:
    """Per parameter (row offset, column offset, w^2 offset) in the step-1 buffer, and its
    length: matrices get their rows then columns, every parameter one w^2 slot at the end."""
    out, pos = [], 0
    for pl in layout.params:
        if len(pl.shape) > 1:
            rows, cols = pl.numel // pl.shape[-1], pl.numel // pl.shape[-2]
            out.append((pos, pos + rows, 0))
            pos += rows + cols
        else:
            out.append((-1, -1, 0))
    for i, (r, c, _) in enumerate(out):
        out[i] = (r, c, pos + i)
    return out, pos + len(out)


def _plan(optimizer, layout: ShardLayout) -> tuple[list, int, dict]:
    """(segments, buffer length, each piece's element indices by parameter), made on the
    first step over ``layout`` and kept: a layout does not change during a run."""
    plan = getattr(optimizer, "_sharded_plan", None)
    if plan is None or plan[0] is not layout:
        plan = (layout, *_segments(layout), {})
        optimizer._sharded_plan = plan
    return plan[1:]


def _indices(pl: ParamLayout, lo: int, hi: int, device) -> tuple[torch.Tensor, ...]:
    """For flat elements [lo, hi) of a (..., n, m) parameter: each one's row (over every
    leading index), column (per leading index) and leading index."""
    n, m = pl.shape[-2], pl.shape[-1]
    flat = torch.arange(lo, hi, device=device)
    lead = flat // (n * m)
    return flat // m, lead * m + flat % m, lead


@torch.no_grad()
def sharded_step(optimizer, layout: ShardLayout) -> None:
    """One Adafactor step over this rank's pieces. Every rank calls it, also one holding no
    piece: it is a collective."""
    segments, length, indices = _plan(optimizer, layout)
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), layout.device)
    sums = torch.zeros(length, device=device)
    items = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            i, pl = layout.parameter_of(p)
            lo, hi = pl.ranges[layout.rank]
            w, g = local(p).reshape(-1), local(p.grad).reshape(-1)
            state = optimizer.make_state(p)
            state["step"] += 1
            rows_at, cols_at, w_at = segments[i]
            sums[w_at] += w.float().square().sum()
            index = None
            if len(pl.shape) > 1:
                if i not in indices:
                    indices[i] = _indices(pl, lo, hi, device)
                index = indices[i]
                square = g * g
                sums[rows_at:cols_at].index_add_(0, index[0], square)
                sums[cols_at : cols_at + pl.numel // pl.shape[-2]].index_add_(0, index[1], square)
            items.append((w, g, state, group, i, pl, index))
    sums = layout.all_reduce_sum(sums)
    u_squares = torch.zeros(len(layout.params), device=device)
    updates = []
    for w, g, state, group, i, pl, index in items:
        update, alpha = _update(w, g, state, group, pl, sums, segments[i], index)
        u_squares[i] += update.square().sum()
        updates.append((w, update, alpha, group, i, pl))
    u_squares = layout.all_reduce_sum(u_squares)
    for w, update, alpha, group, i, pl in updates:
        rms = (u_squares[i].double() / pl.numel).sqrt()
        w.add_(update.mul_((-alpha / (rms / group["d"]).clamp(min=1.0)).to(update.dtype)))


def _update(w, g, state, group, pl: ParamLayout, sums, segment, index):
    """(U of this piece, the relative step alpha), after weight decay and the statistics."""
    lr, wd = group["lr"], group["weight_decay"]
    eps1, eps2 = group["eps"]
    if eps1 is None:
        eps1 = torch.finfo(w.dtype).eps
    beta, rho_t = step_scalars(state["step"], group, w.device)
    one_minus_beta2_t = beta.to(w.dtype)
    rows_at, cols_at, w_at = segment
    alpha = (sums[w_at].double() / pl.numel).sqrt().clamp(min=eps2) * rho_t
    if wd != 0:
        w.mul_(1 - lr * wd)
    if index is None:
        variance = local(state["variance"]).reshape(-1)
        variance.lerp_(g * g, one_minus_beta2_t)
        estimate = variance.clone()
    else:
        n, m = pl.shape[-2], pl.shape[-1]
        row_var, col_var = state["row_var"].view(-1), state["col_var"].view(-1)
        row_var.lerp_(sums[rows_at:cols_at] / m, one_minus_beta2_t)
        col_var.lerp_(sums[cols_at : cols_at + row_var.numel() // n * m] / n, one_minus_beta2_t)
        row_mean = row_var.view(-1, n).mean(dim=-1).clamp_(min=eps1)
        rows, cols, lead = index
        estimate = row_var[rows] * col_var[cols] / row_mean[lead]
    return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g), alpha


def step_scalars(
    step: torch.Tensor, group: dict, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - beta2_t, rho_t) of step count ``step`` (a CPU tensor, as torch keeps it), 0-d
    fp64 tensors on ``device``: the count goes there by a copy, which waits for nothing,
    rather than to Python by a read per parameter."""
    t = step.to(device, torch.float64, non_blocking=True)
    return t.pow(group["beta2_decay"]), (1 / t.sqrt()).clamp(max=group["lr"])
