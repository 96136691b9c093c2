"""``rehearse.*``: ``python -m llm.rehearse``'s options."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_positive
from llm.errors import ConfigError


@dataclass
class RehearseConfig:
    """``python -m llm.rehearse`` (docs/parallel.md, "Rehearsing one rank"): one rank of a
    ``world_size``-rank run, in one process, over torch's fake process group."""

    world_size: int | None = None  # the run's ranks; python -m llm.rehearse requires it
    rank: int = 0  # which of them runs here
    steps: int = 4  # training steps (probes and timed steps alternate)
    json: str | None = None  # where the figures go; None: rehearse.json in the run directory

    def __post_init__(self) -> None:
        require_positive("rehearse", world_size=self.world_size, steps=self.steps)
        if self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rehearse.rank={self.rank} is not a rank of a {self.world_size}-rank run; pick "
                f"0 to {self.world_size - 1}"
            )
