"""``scheduler.*``: the learning-rate schedule (conf/scheduler/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice
from llm.errors import ConfigError


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the final lr as a fraction of optimizer.lr
    decay_ratio: float = 0.2  # wsd: the share of steps spent decaying at the end

    def __post_init__(self) -> None:
        require_choice("scheduler", "name", self.name, ("cosine", "linear", "constant", "wsd"))
        if self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ConfigError(f"scheduler.decay_ratio={self.decay_ratio} must be in (0, 1]")
