"""Stand-ins for llm.run.main that the launcher's spawned ranks run in fast tests: spawn
imports them by name, so they live in a module of their own, with nothing heavy to import."""

from __future__ import annotations

import signal
import time
from pathlib import Path


def fails_on_rank1(cfg, env) -> dict:
    if env.rank == 1:
        raise RuntimeError("injected fault on rank 1")
    time.sleep(120)  # rank 0 waits in a collective; the launcher ends it
    return {}


def checkpoints_on_sigterm(cfg, env) -> dict:
    """A rank that trains until SIGTERM, then writes a checkpoint (rank 0) and returns."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as the Trainer's handler would catch it
    (Path(cfg.output_dir) / f"ready{env.rank}").touch()
    deadline = time.monotonic() + 120
    while not stop and time.monotonic() < deadline:
        time.sleep(0.05)
    if env.rank == 0 and stop:
        checkpoint = Path(cfg.output_dir) / "checkpoints" / "step_000003"
        checkpoint.mkdir(parents=True)
        (checkpoint / "meta.json").write_text("{}")
    return {}


def slow_to_stop(cfg, env) -> dict:
    """A rank whose checkpoint after SIGTERM takes long (it waits out the signal): only a
    second Ctrl-C, which the launcher turns into SIGKILL, ends it soon."""
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    (Path(cfg.output_dir) / f"ready{env.rank}").touch()
    time.sleep(120)
    return {}
