"""Stopping on a signal, at any moment of a run, without losing a completed step.

One guard per process, installed as early as the process can (train.py before Hydra runs;
a spawned rank before it builds anything) and kept until the process ends, so no moment
of a run (start-up, a step, an evaluation, a checkpoint write, the final save, shutdown)
falls back to Python's default handlers. SIGTERM and the first SIGINT only set a flag: the
loop saves a checkpoint and exits at the next step boundary where every rank has seen the
vote (within 2 steps: llm.train.stop_vote), an evaluation ends between two batches, and the
moments outside the loop ask the flag themselves (llm.train.trainer). A second Ctrl-C stops
at once (KeyboardInterrupt): checkpoints are written atomically, so the newest complete one
stays the newest. Slurm sends SIGTERM some time before SIGKILL (``--signal``, or
``KillWait`` alone), which must cover those steps and the save (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(name: str) -> int:
    """The shell's code for a process ended by ``name``: 128 + its number (130, 143)."""
    return 128 + signal.Signals[name].value


STOP_CODES = frozenset(exit_code(sig.name) for sig in STOP_SIGNALS)


def announce_stop(name: str) -> None:
    """What a person sees at once after Ctrl-C or SIGTERM, on the terminal's stderr (file
    descriptor 2, written directly: a handler may run while the main thread prints)."""
    what, again = ("Ctrl-C", "; Ctrl-C again to stop now") if name == "SIGINT" else (name, "")
    with contextlib.suppress(OSError):  # a closed stderr must not break the stop
        os.write(2, f"{what}: stopping after this step{again}\n".encode())


class StopRequested:
    """SIGTERM/SIGINT recorded for this process: ``requested``, and ``signal``, the first
    one's name (SIGINT for Ctrl-C, or SIGTERM). ``announce``: say at once, on stderr, what
    happens next (the process that owns the terminal does; spawned ranks do not)."""

    def __init__(self, announce: bool = False) -> None:
        self.requested = False
        self.signal: str | None = None
        self.announce = announce
        self._previous: dict = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        first = not self.requested
        self.requested = True
        self.signal = self.signal or name
        if first and self.announce:
            announce_stop(name)

    def __enter__(self) -> StopRequested:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


_active: list[StopRequested] = []  # the installed guard: signal handlers are per process


@contextmanager
def stop_guard(announce: bool = False) -> Iterator[StopRequested]:
    """The process's guard: installed here if none is yet (and removed on leaving), else the
    one an earlier caller installed, so nested entry points share one record of signals."""
    if _active:
        yield _active[-1]
        return
    guard = StopRequested(announce)
    _active.append(guard)
    guard.install()
    try:
        yield guard
    finally:
        guard.restore()
        _active.remove(guard)
