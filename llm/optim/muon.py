"""Muon for the hidden matrices, AdamW for everything else, as one optimizer.

Muon (Jordan et al., 2024) takes the Nesterov momentum of a 2-D weight's gradient and
replaces it by its nearest semi-orthogonal matrix (five Newton-Schulz iterations), so every
direction of the matrix moves by the same amount. It is meant for the matrices inside
transformer blocks only; embeddings, the output head and 1-D params (norm gains, biases)
stay with AdamW, as its users' recipes do (Keller Jordan's modded-nanogpt, Moonlight).
State: Muon's momentum (4 bytes per element) on hidden matrices, AdamW's 8 bytes + a
4-byte step elsewhere.

``Muon`` is ours, torch.optim.Muon's step operation for operation (the same bits with
``ns_dtype=bfloat16``, tests/test_muon.py), for two things torch's cannot do: Newton-Schulz in
fp32 (``ns_dtype``), and matrices sharded over ranks. With a ``shard_layout`` (set by our
ZeRO and by FSDP) each rank steps its pieces: momentum and weight decay are element-wise,
and the Newton-Schulz input is made whole in one of two ways (``distributed``):
- ``gather`` (Moonlight's Distributed Muon, Liu et al., 2025, §2.3): one all-gather of every
  rank's pieces of every hidden matrix; each rank orthogonalises every matrix it holds a
  piece of and keeps its piece of the result;
- ``owner``: each matrix has one owner, assigned by Newton-Schulz FLOPs (largest first to the
  least loaded rank); pieces go to owners and results come back in one all-to-all each, and
  no matrix is orthogonalised twice.
The lr adjustment reads the whole matrix's shape, not the piece's.

``adjust_lr="match_rms_adamw"`` (Moonlight) scales Muon's update to the RMS of an AdamW
update, so one lr and one weight decay serve both halves and the scheduler drives them
together; ``"original"`` is Keller Jordan's max(1, rows/cols)^0.5 scaling, which wants a much
larger lr (~0.02) than AdamW's.

The two inner optimizers share this object's param groups and state: ``step`` points each
at its own groups (re-read every step, since ``load_state_dict`` replaces the group dicts)
and at this object's ``state``, so checkpoints, the LR scheduler and ``zero_grad`` see one
ordinary optimizer.
"""

from __future__ import annotations

import math

import torch

from llm.optim.lazy_state import materialize_state
from llm.optim.shard_layout import OwnerExchange, ShardLayout, balanced_owners
from llm.optim.tensors import local

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(
    update: torch.Tensor, steps: int, dtype: torch.dtype, coefficients=NS_COEFFICIENTS
) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``update`` (2-D), approximately: torch.optim.Muon's
    ``_zeropower_via_newtonschulz`` with the working dtype as a choice. Returns ``dtype``."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """Matmul FLOPs of ``newton_schulz`` on a matrix of ``shape``: per iteration, with n <= m
    the short side, X X^T (2n^2m), the Gram polynomial's product (2n^3) and its product with
    X (2n^2m)."""
    n, m = sorted(shape[:2])
    return steps * (4 * n * n * m + 2 * n**3)


def adjusted_lr(lr: float, how: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's lr adjustment, from the whole matrix's shape."""
    rows, cols = shape[:2]
    if how is None or how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    shard_layout: ShardLayout | None = None

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        distributed: str = "gather",
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or distributed not in ("gather", "owner"):
            raise ValueError(
                f"Muon needs lr, momentum, weight_decay >= 0 and distributed gather|owner, got "
                f"{lr}, {momentum}, {weight_decay}, {distributed!r}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        self.ns_dtype, self.distributed = ns_dtype, distributed
        self._exchange: OwnerExchange | None = None  # made on the first owner-mode step

    def make_state(self, p: torch.Tensor, group_index: int = 0) -> dict:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = []  # (param, its Nesterov update, group), local tensors
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, buf = local(p.grad), local(self.make_state(p)["momentum_buffer"])
                buf.lerp_(grad, 1 - mu)
                items.append((p, grad.lerp(buf, mu) if group["nesterov"] else buf, group))
        if self.shard_layout is None:
            for p, update, group in items:
                ortho = newton_schulz(update, group["ns_steps"], self.ns_dtype)
                _apply(local(p), ortho, group, tuple(p.shape))
        else:
            self._sharded_step(items)
        return loss

    def _sharded_step(self, items) -> None:
        """Every rank calls it, also with no piece of any matrix: it is a collective."""
        layout = self.shard_layout
        steps = next(iter(self.param_groups), {}).get("ns_steps", 5)
        wanted = [i for i, pl in enumerate(layout.params) if pl.kind == "hidden"]
        pieces = {layout.parameter_of(p)[0]: update.reshape(-1) for p, update, _ in items}
        if self.distributed == "gather":
            whole = layout.gather_whole(wanted, pieces)
            results = {}
            for i in pieces:
                shape = layout.params[i].shape
                lo, hi = layout.params[i].ranges[layout.rank]
                results[i] = newton_schulz(whole[i].view(shape), steps, self.ns_dtype).reshape(-1)[
                    lo:hi
                ]
        else:
            if self._exchange is None or self._exchange.layout is not layout:
                costs = {i: newton_schulz_flops(layout.params[i].shape, steps) for i in wanted}
                owners = balanced_owners(costs, layout.world)
                self._exchange = OwnerExchange(layout, wanted, owners)
            exchange = self._exchange
            whole = exchange.to_owners(pieces)
            ortho = {
                i: newton_schulz(w.view(layout.params[i].shape), steps, self.ns_dtype).reshape(-1)
                for i, w in whole.items()
            }
            results = exchange.from_owners(ortho)
        for p, _, group in items:
            i, pl = layout.parameter_of(p)
            target = local(p)
            _apply(target, results[i].to(target.device).view(target.shape), group, pl.shape)


def _apply(p: torch.Tensor, ortho: torch.Tensor, group: dict, shape: tuple[int, ...]) -> None:
    """Decoupled weight decay, then the orthogonalised step (torch.optim.Muon's order)."""
    lr = group["lr"]
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], muon: dict, adamw: dict):
        hidden = [g for g in groups if g.get("kind") == "hidden"]
        rest = [g for g in groups if g.get("kind") != "hidden"]
        self._muon = Muon(hidden, **muon) if hidden else None
        self._adamw = torch.optim.AdamW(rest, **adamw) if rest else None
        inner = [o for o in (self._muon, self._adamw) if o is not None]
        # The inner optimizers filled each group with their own defaults; these dicts
        # become this optimizer's groups.
        super().__init__([g for o in inner for g in o.param_groups], {})

    @property
    def shard_layout(self) -> ShardLayout | None:
        return None if self._muon is None else self._muon.shard_layout

    @shard_layout.setter
    def shard_layout(self, layout: ShardLayout | None) -> None:
        if self._muon is not None:
            self._muon.shard_layout = layout

    def _share_groups_with(self, inner: torch.optim.Optimizer, hidden: bool) -> None:
        """Hand ``inner`` (Muon or AdamW) this optimizer's groups of its kind (the hidden
        matrices, or the rest) and this optimizer's state, as the same objects."""
        inner.param_groups = [g for g in self.param_groups if (g.get("kind") == "hidden") == hidden]
        inner.state = self.state

    def make_state(self, p: torch.Tensor, group_index: int) -> None:
        """``p``'s state without a step (a sharded Muon step is a collective, which a caller
        making one rank's state alone must not start): Muon's momentum, or AdamW's moments
        from one zero-lr step of AdamW alone."""
        group = self.param_groups[group_index]
        if group.get("kind") == "hidden":
            self._share_groups_with(self._muon, True)
            self._muon.make_state(p)
            return
        self._share_groups_with(self._adamw, False)
        index = next(i for i, g in enumerate(self._adamw.param_groups) if g is group)
        materialize_state(self._adamw, [(p, index)])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner, hidden in ((self._muon, True), (self._adamw, False)):
            if inner is not None:
                self._share_groups_with(inner, hidden)
                inner.step()
        return loss
