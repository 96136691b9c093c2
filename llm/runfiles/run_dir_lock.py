"""One run per run directory: an exclusive ``fcntl.flock`` on ``<run>/.lock``.

Two runs in one directory remove each other's temporary checkpoints, resume from each
other's checkpoints and interleave metrics.jsonl. The process that owns the run (the
launcher, or rank 0 under torchrun / Slurm) holds the lock for the run's lifetime; the
kernel frees it when that process ends, however it ends, so a crash leaves no stale lock.
The file keeps the holder's PID and host for the message a second run gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from llm.errors import ConfigError

LOCK_FILE = ".lock"


class RunDirLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise ConfigError(
                f"run directory {self.path.parent} is in use by another run ({holder}); wait "
                "for it to finish or stop it, or give this run its own hydra.run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"PID {os.getpid()} on host {socket.gethostname()}".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
