"""Stopping on a signal at a step every rank agrees on, with a checkpoint."""

from __future__ import annotations

import signal


class StopRequested:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits at the next step
    whose results are read (a logged or checkpoint step: at most ``train.log_every`` steps
    later, since every rank must see the vote at the same step). Slurm preemption sends
    SIGTERM some time before SIGKILL (``--signal``), which must cover those steps."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: str | None = None  # the first one's name: SIGINT (Ctrl-C) or SIGTERM
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal = self.signal or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
