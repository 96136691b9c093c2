"""``recompute.*``: which activations are kept for backward (conf/recompute/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError

RECOMPUTE_NAMES = ("none", "full", "selective", "op_sac", "budget", "offload")


@dataclass
class RecomputeConfig:
    """Which activations are kept for backward (llm/recompute, docs/recompute.md)."""

    name: str = "none"  # none | full | selective | op_sac | budget | offload
    every: int = 1  # full: recompute every k-th block (1 = all blocks)
    # op_sac: keep only every other linear matmul's output (torchtitan's option).
    save_every_other_mm: bool = False
    # budget: the compiler's activation memory budget, 0 (recompute most) to 1 (keep most).
    memory_budget: float = 0.5

    def __post_init__(self) -> None:
        require_choice("recompute", "name", self.name, RECOMPUTE_NAMES)
        require_positive("recompute", every=self.every)
        if not 0.0 <= self.memory_budget <= 1.0:
            raise ConfigError(
                f"recompute.memory_budget={self.memory_budget} must be in [0, 1]; "
                "0 recomputes all it can, 1 keeps what the default partition keeps"
            )
        if self.save_every_other_mm and self.name != "op_sac":
            raise ConfigError(
                f"recompute.save_every_other_mm=true applies to recompute=op_sac only, not "
                f"recompute={self.name}; drop it or use recompute=op_sac"
            )
