"""What the training loop carries from step to step on the host."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.train.timed_steps import TimedSteps


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0  # target tokens (padding excluded) of every global batch so far
    last_loss: float | None = None
    last_val_loss: float | None = None
    timed: TimedSteps = field(default_factory=TimedSteps)  # the steps that ran no instrument
    probe_steps: int = 0  # this invocation's steps that ran the instruments
    comm_per_step: dict[str, int] = field(default_factory=dict)
    comm_steps: int = 0  # the probe steps whose bytes comm_per_step sums
    skipped_steps: int = 0  # overflowing steps the strategy did not apply
