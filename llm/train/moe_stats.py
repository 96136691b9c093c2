"""The trainer's side of mixture-of-experts layers (llm/models/moe.py).

- Each training micro-batch's backward takes the layers' auxiliary losses (balance, z) on
  top of the data loss, once per step: divided by the micro-batches of the step.
- The step's expert load, assignments per expert summed over its micro-batches, is the same
  on every rank (each layer's exchange sums counts over the data-parallel ranks). After the
  optimizer step it moves a sigmoid router's bias towards balance (DeepSeek-V3), unless the
  step was skipped, with no collective of its own.
- Under ``model.moe.balance_loss=pooled`` the balance loss is one over every layer
  (transformers' Mixtral loss, llm.models.moe.pooled_balance_loss), made here after the
  forward, since it needs every layer's rows.
- Logged steps carry the load per layer and expert (metrics.jsonl, and W&B through the
  logger), its max / mean per layer, the balance loss (per_layer: the layers' mean, 1 at
  perfect balance; pooled: the one loss, top_k at perfect balance) and the z loss (the
  layers' mean), and the share of assignments that a capacity dropped. The balance and z
  losses are the whole batch's: each rank's own figure is a mean over its rows, and the
  Trainer averages them over the data-parallel ranks in the collective that sums the
  logged step's losses (``logged_losses``, ``take_global``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llm.models.moe import moe_layers, pooled_balance_loss


class MoEStats:
    def __init__(self, model: nn.Module, micro_batches: int) -> None:
        self.layers = moe_layers(model)
        self.micro_batches = micro_batches
        self._reset()
        self.last: dict[str, Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _reset(self) -> None:
        self._load: Tensor | None = None  # (L, E)
        self._kept: Tensor | None = None  # (L,) assignments the capacity kept
        self._balance: Tensor | None = None  # () the logged figure, summed over micro-batches
        self._z: Tensor | None = None  # () the layers' mean, summed over micro-batches

    def aux_loss(self) -> Tensor | None:
        """After a training forward: the auxiliary loss its backward adds (None when no
        layer weighs one in), and the forward's load, added to the step's."""
        load = torch.stack([layer.load for layer in self.layers]).float()
        kept = torch.stack([layer.kept for layer in self.layers]).float()
        balance, pooled = self._balance_loss()
        z = torch.stack([layer.z_loss for layer in self.layers]).mean()
        if self._load is None:
            self._load, self._kept, self._balance, self._z = load, kept, balance, z
        else:
            self._load += load
            self._kept += kept
            self._balance += balance
            self._z += z
        terms = [layer.aux_loss for layer in self.layers if layer.aux_loss is not None]
        if pooled is not None:
            terms.append(pooled)
        return sum(terms) / self.micro_batches if terms else None

    def _balance_loss(self) -> tuple[Tensor, Tensor | None]:
        """The forward's balance loss as logged, and under ``pooled`` the weighted term its
        backward adds (None when per-layer, whose terms are in the layers' aux_loss, or
        weighted 0)."""
        moe = self.layers[0].moe
        if moe.balance_loss == "per_layer":
            return torch.stack([layer.balance_loss for layer in self.layers]).mean(), None
        balance = pooled_balance_loss(self.layers)
        return balance.detach(), moe.aux_loss_coef * balance if moe.aux_loss_coef > 0 else None

    @torch.no_grad()
    def after_step(self, skipped: bool | Tensor) -> None:
        """Bias updates from the step's load (not for a skipped step); the step's figures
        become ``last`` for logging."""
        applied = 1.0 - torch.as_tensor(skipped, dtype=torch.float32, device=self._load.device)
        for layer, load in zip(self.layers, self._load, strict=True):
            if layer.moe.router == "sigmoid":
                layer.router.update_bias(load, applied)
        self.last = {
            "load": self._load,
            "kept": self._kept,
            "balance": self._balance / self.micro_batches,
            "z": self._z / self.micro_batches,
        }
        self._reset()

    def logged_losses(self) -> list[Tensor]:
        """This rank's balance and z losses of the last step (0-d; none before a step or
        without MoE layers), for the Trainer to sum over ranks with the step's losses."""
        return [self.last["balance"], self.last["z"]] if self.last else []

    def take_global(self, means: Tensor) -> None:
        """The last step's balance and z losses averaged over the data-parallel ranks (the
        sums of ``logged_losses`` over ranks, divided): the whole batch's, to be logged."""
        self.last["balance"], self.last["z"] = means

    def take_sent(self) -> dict[str, int]:
        """Bytes the layers' exchanges sent since the last call (counts, all-to-all)."""
        sent: dict[str, int] = {}
        for layer in self.layers:
            for kind, n in layer.exchange.take_sent().items():
                sent[kind] = sent.get(kind, 0) + n
        return sent

    def metrics(self) -> dict:
        """The last step's figures for the logger (one host read)."""
        if not self.last:
            return {}
        load = self.last["load"].tolist()
        out: dict = {
            "moe/balance_loss": self.last["balance"].item(),
            "moe/z_loss": self.last["z"].item(),
            # W&B gets one series per layer and expert: moe/load/layer0/expert3.
            "moe/load": {
                f"layer{i}": {f"expert{e}": int(v) for e, v in enumerate(row)}
                for i, row in enumerate(load)
            },
            "moe/max_over_mean": {
                f"layer{i}": max(row) / (sum(row) / len(row)) if sum(row) else 0.0
                for i, row in enumerate(load)
            },
        }
        total = self.last["load"].sum()
        out["moe/dropped_share"] = (1 - self.last["kept"].sum() / total.clamp(min=1)).item()
        return out
