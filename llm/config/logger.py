"""``logger.*``: W&B and the progress bar (conf/logger/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.config.require import require_choice


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none (metrics.jsonl and summary.json are always written)
    project: str = "llm-training-lab"
    entity: str | None = None
    mode: str = "auto"  # auto: online when W&B credentials exist, else offline
    group: str | None = None  # None: the sweep directory name under -m, else no group
    tags: list[str] = field(default_factory=list)
    progress: bool = True  # the rank-0 progress bar

    def __post_init__(self) -> None:
        require_choice("logger", "name", self.name, ("wandb", "none"))
        require_choice("logger", "mode", self.mode, ("auto", "online", "offline", "disabled"))
