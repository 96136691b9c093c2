"""``monitor.*``: the training monitor's alerts (conf/monitor/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice


@dataclass
class MonitorConfig:
    name: str = "default"  # default | none
    stop_on_nan: bool = True
    loss_spike_factor: float = 3.0  # alert when loss > factor * its running mean
    grad_norm_alert: float = 100.0  # alert when the pre-clip grad norm exceeds this
    max_alerts: int = 20

    def __post_init__(self) -> None:
        require_choice("monitor", "name", self.name, ("default", "none"))
