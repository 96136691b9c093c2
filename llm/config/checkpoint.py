"""``checkpoint.*``: when checkpoints are written, kept and resumed from."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_positive
from llm.errors import ConfigError


@dataclass
class CheckpointConfig:
    every: int = 0  # 0: only at the end of training
    keep_last: int = 2
    resume: str = "auto"  # auto | none | PATH
    enabled: bool = True
    # Tensor bytes per file: torch DCP's writer holds a file's tensors (copies of shards that
    # are views) until the file is closed, so this bounds a save's temporary memory.
    file_mb: float = 25.0  # as parallelism.bucket_cap_mb

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every={self.every} must be >= 0 (0: only at the end)")
        require_positive("checkpoint", keep_last=self.keep_last, file_mb=self.file_mb)
