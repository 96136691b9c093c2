"""The mixture-of-experts feed-forward: a router sends each token to top_k of n_experts
SwiGLU experts, whose outputs come back weighted; optional shared experts see every token.

Tokens move as (token, slot) assignments sorted by expert, so each expert's tokens are one
contiguous run: the experts compute through one grouped matmul (``torch._grouped_mm``) or a
loop over the runs (:class:`Experts`). Where the experts live is the ``exchange``'s business:
:class:`LocalExchange` (every expert here) unless llm/parallel/experts/install.py installs one
that moves the runs to the ranks of their experts and back. The exchange also sums each
expert's count over the data-parallel ranks, so the balance loss and the capacity see the
global micro-batch, the same as one process that runs it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.models.args import ModelArgs


@dataclass
class Routing:
    experts: Tensor  # (N, k) int64: the experts each token goes to
    weights: Tensor  # (N, k) fp32: what each expert's output is multiplied by
    logits: Tensor  # (N, E) fp32: the router's raw scores (the z-loss reads them)
    probs: Tensor  # (N, E) fp32: the distribution the balance loss averages


class Router(nn.Module):
    """softmax: top-k of softmax(logits) (Mixtral); sigmoid: top-k of sigmoid(logits) + bias,
    weighted by sigmoid(logits) alone (DeepSeek-V3). The bias is a buffer: no gradient moves
    it, :meth:`update_bias` does, after each step."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.moe = args.moe
        self.gate = nn.Linear(args.d_model, args.moe.n_experts, bias=False)
        if self.moe.router == "sigmoid":
            self.register_buffer("bias", torch.zeros(args.moe.n_experts))

    def forward(self, h: Tensor) -> Routing:
        logits = self.gate(h).float()  # (N, E), fp32 as HF's Mixtral router
        k = self.moe.top_k
        if self.moe.router == "softmax":
            probs = logits.softmax(-1)
            weights, experts = probs.topk(k, dim=-1)
        else:
            scores = logits.sigmoid()
            experts = (scores + self.bias).topk(k, dim=-1).indices
            weights = scores.gather(-1, experts)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.moe.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(experts, weights, logits, probs)

    @torch.no_grad()
    def update_bias(self, load: Tensor, applied: Tensor | float = 1.0) -> None:
        """Raise the bias of experts below the mean load, lower it above (DeepSeek-V3, 2.1.2);
        ``load`` (E,): tokens per expert over the step, the same on every rank; ``applied``
        0 leaves it (a skipped step; a device tensor, so no host read)."""
        load = load.float()
        self.bias += applied * self.moe.bias_update_rate * torch.sign(load.mean() - load)


class Experts(nn.Module):
    """``n`` SwiGLU experts stacked: w1, w3 (n, F, d) and w2 (n, d, F), the layout of one
    grouped matmul; expert e is Llama's w2(silu(w1 x) * w3 x) with the e-th matrices."""

    def __init__(self, n: int, d_model: int, d_hidden: int, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.w1 = nn.Parameter(torch.empty(n, d_hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n, d_hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n, d_model, d_hidden))

    def forward(self, x: Tensor, counts: Tensor, host_counts: list[int] | None = None) -> Tensor:
        """x (M, d): the tokens of expert 0, then of expert 1, ... (``counts`` (n,) of each,
        ``host_counts`` the same on the host where the caller has read them already);
        returns (M, d) in the same order. The grouped kernel takes the counts on the device;
        the loop reads them on the host where they were not given."""
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        if self._grouped(x.device, dtype):
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(_grouped(x, w1, offs)) * _grouped(x, w3, offs)
            return _grouped(h, w2, offs)
        out, start = [], 0
        for e, count in enumerate(counts.tolist() if host_counts is None else host_counts):
            xe = x[start : start + count]
            out.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
            start += count
        return torch.cat(out) if out else x.new_zeros(0, x.size(-1))

    def reads_counts(self, x: Tensor) -> bool:
        """Whether this forward reads the counts on the host (the loop kernel does)."""
        return not self._grouped(x.device, _compute_dtype(x))

    def _grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        if self.kernel != "auto":
            return self.kernel == "grouped"
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return False
        return torch.cuda.get_device_capability(device) >= (9, 0)


def _grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Row run g of ``x`` times w[g]^T, every run in one kernel."""
    out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if out.requires_grad:  # its backward refuses a broadcast gradient (stride 0), as sum()'s
        out.register_hook(torch.Tensor.contiguous)
    return out


def _count(experts: Tensor, n: int) -> Tensor:
    """Assignments per expert, (n,) int64: bincount's, without its host read (CUDA's
    bincount reads the largest value to size its output)."""
    return experts.new_zeros(n).index_add_(0, experts, torch.ones_like(experts))


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (a grouped matmul is not on its cast list)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class LocalExchange:
    """Every expert on this rank and this rank's tokens alone: counts are its own."""

    def count(self, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(each expert's assignments over the global micro-batch, those on earlier ranks)."""
        return counts, torch.zeros_like(counts)

    def run(self, experts: Experts, x: Tensor, counts: Tensor, tokens: int, top_k: int) -> Tensor:
        """The experts' outputs for ``x`` (rows sorted by expert, ``counts`` (E,) of each),
        from ``tokens`` tokens with ``top_k`` experts each (the bound an exchange with
        fixed-size buffers sizes them by)."""
        return experts(x, counts)

    def take_sent(self) -> dict[str, int]:
        """Bytes sent to other ranks since the last call: none, in one process."""
        return {}


class SharedExperts(nn.Module):
    """n_shared_experts always-on experts as one SwiGLU of their summed width."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_hidden, bias=False)
        self.w3 = nn.Linear(d_model, d_hidden, bias=False)
        self.w2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """(B, T, d) -> (B, T, d). After a training forward: ``aux_loss`` (the weighted
    per-layer balance and z losses, or None when none is weighed in), ``load`` (E,)
    assignments per expert over the global micro-batch before any drop, ``kept`` how many of
    the global micro-batch's assignments the capacity kept, and the unweighted
    ``balance_loss`` (per_layer; None when pooled) and ``z_loss`` for logging. Under
    ``balance_loss=pooled`` the block leaves ``probs_sum`` (E,), its rows' router
    probabilities summed, and ``rows``, for :func:`pooled_balance_loss` over every block."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.moe = args.moe
        self.router = Router(args)
        self.experts = Experts(args.moe.n_experts, args.d_model, args.d_expert, args.moe.kernel)
        width = args.moe.n_shared_experts * args.d_expert
        self.shared = SharedExperts(args.d_model, width) if width else None
        self.dropout = nn.Dropout(args.dropout)
        self.exchange = LocalExchange()
        self.aux_loss: Tensor | None = None
        self.load: Tensor | None = None
        self.kept: Tensor | None = None
        self.balance_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.probs_sum: Tensor | None = None
        self.rows = 0

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = x.reshape(-1, d)  # (N, d)
        route = self.router(h)
        flat = route.experts.reshape(-1)  # (N k,): token-major, slot-minor
        n_experts = self.moe.n_experts
        mine = _count(flat, n_experts)  # this rank's assignments
        total, before = self.exchange.count(mine)
        order = torch.argsort(flat, stable=True)  # by expert, then token, then slot
        if self.moe.capacity_factor is not None:
            order = self._within_capacity(flat, order, mine, total, before)
        counts = _count(flat[order], n_experts)
        token = order // self.moe.top_k
        y = self.exchange.run(self.experts, h[token], counts, h.shape[0], self.moe.top_k)
        weights = route.weights.reshape(-1)[order]
        # fp32 product cast back, then summed per token: HF Mixtral's order of rounding.
        contrib = (y * weights.unsqueeze(-1)).to(h.dtype)
        out = torch.zeros_like(h).index_add_(0, token, contrib)
        if self.shared is not None:
            out = out + self.shared(h)
        if self.training:
            self._record(route, total)
        return self.dropout(out.view(b, t, d))

    def capacity(self, assignments: Tensor) -> Tensor:
        """Slots per expert: ceil(capacity_factor * tokens * top_k / n_experts) for the
        global micro-batch's ``assignments`` (tokens * top_k)."""
        return torch.ceil(assignments * self.moe.capacity_factor / self.moe.n_experts)

    def _within_capacity(
        self, flat: Tensor, order: Tensor, mine: Tensor, total: Tensor, before: Tensor
    ) -> Tensor:
        """``order`` without the assignments past their expert's capacity: the global
        micro-batch's first come (earlier ranks, then earlier tokens) are kept."""
        sorted_experts = flat[order]
        starts = torch.cumsum(mine, 0) - mine  # where each expert's run begins in ``order``
        rank_in_expert = torch.arange(order.numel(), device=flat.device) - starts[sorted_experts]
        slot = before[sorted_experts] + rank_in_expert  # place in the global queue
        return order[slot < self.capacity(total.sum())]

    def _record(self, route: Routing, total: Tensor) -> None:
        moe = self.moe
        # f_i over the global micro-batch (no gradient), P_i over this rank's tokens: the
        # mean over ranks of each rank's loss is the global batch's (Switch eq. 4).
        share = total.float() / total.sum().clamp(min=1)
        grad = torch.is_grad_enabled()
        per_layer = moe.balance_loss == "per_layer"
        # A loss weighted 0 is only logged: no graph keeps its inputs for a backward.
        with torch.set_grad_enabled(grad and moe.aux_loss_coef > 0):
            if per_layer:
                balance = moe.n_experts * (share * route.probs.mean(0)).sum()
            else:  # the model's one loss needs every block's rows: pooled_balance_loss
                self.probs_sum, self.rows = route.probs.sum(0), route.probs.size(0)
        with torch.set_grad_enabled(grad and moe.z_loss_coef > 0):
            z = torch.logsumexp(route.logits, dim=-1).square().mean()
        weighed = ([(moe.aux_loss_coef, balance)] if per_layer else []) + [(moe.z_loss_coef, z)]
        terms = [c * loss for c, loss in weighed if c > 0]
        self.aux_loss = sum(terms) if terms else None
        self.balance_loss = balance.detach() if per_layer else None
        self.z_loss = z.detach()
        self.load = total
        # The global queue keeps each expert's first `capacity` assignments.
        kept = total if moe.capacity_factor is None else total.clamp(max=self.capacity(total.sum()))
        self.kept = kept.sum()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def pooled_balance_loss(layers: list[MoE]) -> Tensor:
    """transformers' ``load_balancing_loss_func`` (Mixtral) over the last training forward of
    ``layers``, a model's MoE blocks: every block's router rows pooled into one set, f_i the
    assignments to expert i per row (no gradient), P_i the mean probability of expert i,
    ``E * sum_i f_i * P_i``: top_k at perfect balance. f_i counts the global micro-batch, P_i
    this rank's rows, so the mean over data-parallel ranks is the global batch's loss, as for
    the per-layer loss (equal rows per rank). Padding rows count, as transformers' without an
    attention_mask."""
    moe = layers[0].moe
    load = torch.stack([layer.load for layer in layers]).sum(0).float()
    assignments_per_row = load / (load.sum() / moe.top_k).clamp(min=1)
    probs = torch.stack([layer.probs_sum for layer in layers]).sum(0)
    mean_probs = probs / sum(layer.rows for layer in layers)
    return moe.n_experts * (assignments_per_row * mean_probs).sum()
