"""Threshold alerts on the training metrics, and a hard stop on NaN/inf.

The Trainer calls ``Monitor.check(step, metrics)`` for each optimizer step, when it reads the
steps' results (on logged steps: up to ``train.log_every`` steps later), and logs the alert
strings it returns; a non-finite loss or grad norm raises TrainingError instead, since
every step after it is wasted compute.
"""

from __future__ import annotations

import math
from typing import Any

from llm.config import MonitorConfig
from llm.errors import TrainingError

# The running loss is an exponential moving average: a plain mean since step 0 stays
# dominated by the high early losses and would hide later spikes. 0.9 remembers ~10 steps.
_EMA_DECAY = 0.9
_FIX = "lower optimizer.lr, keep train.grad_clip > 0, or resume from the last checkpoint (checkpoint.resume=auto)"


class Monitor:
    """Checks ``loss`` and ``grad_norm`` in each step's metrics; ``monitor=none`` checks nothing."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.enabled = cfg.name != "none"
        self.alerts = 0
        self.loss_mean: float | None = None

    def check(self, step: int, metrics: dict[str, Any]) -> list[str]:
        """Alert strings for this step (empty when all is well or after ``max_alerts``).

        ``metrics`` may hold floats or 0-d tensors; missing keys are not checked. A step the
        loss scaler skipped (``metrics["skipped"]`` true) is expected to have an inf grad norm
        and is not treated as divergence.
        """
        if not self.enabled:
            return []
        found = []
        loss = _as_float(metrics.get("loss"))
        grad_norm = _as_float(metrics.get("grad_norm"))
        if grad_norm is not None and metrics.get("skipped"):
            grad_norm = None
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            if value is not None and not math.isfinite(value):
                message = f"{name} is {value} at step {step}: {_FIX}"
                if self.cfg.stop_on_nan:
                    raise TrainingError(message)
                found.append(message)
        if loss is not None and math.isfinite(loss):
            if self.loss_mean is not None and loss > self.cfg.loss_spike_factor * self.loss_mean:
                found.append(
                    f"loss spike at step {step}: {loss:.4g} > {self.cfg.loss_spike_factor:g} x "
                    f"running mean {self.loss_mean:.4g}"
                )
            self._update_mean(loss)
        if grad_norm is not None and grad_norm > self.cfg.grad_norm_alert:
            found.append(
                f"grad norm {grad_norm:.4g} at step {step} exceeds monitor.grad_norm_alert="
                f"{self.cfg.grad_norm_alert:g}"
            )
        return self._limit(found)

    def _update_mean(self, loss: float) -> None:
        if self.loss_mean is None:
            self.loss_mean = loss
        else:
            self.loss_mean = _EMA_DECAY * self.loss_mean + (1.0 - _EMA_DECAY) * loss

    def _limit(self, found: list[str]) -> list[str]:
        """Keep the alert stream readable: at most ``max_alerts`` in a run, then silence."""
        room = max(self.cfg.max_alerts - self.alerts, 0)
        kept = found[:room]
        self.alerts += len(kept)
        if kept and self.alerts == self.cfg.max_alerts:
            kept[-1] += (
                f" (monitor.max_alerts={self.cfg.max_alerts} reached; later alerts are muted)"
            )
        return kept


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)
