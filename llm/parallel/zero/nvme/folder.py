"""Where a rank's offloaded files live: ``<nvme_path>/llm-offload.<host>.<pid>.<random>/``,
one folder per rank and run, removed when the run ends.

A run killed before it could remove its folder leaves it behind; the next rank to start on
the same host removes every such folder whose process is gone (its pid is in the name), and
never opens another run's files, since each run's name is unique.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from llm.errors import ConfigError, DiskFullError
from llm.parallel.zero.nvme.direct_file import no_space_for_states
from llm.runfiles.disk import free_bytes

PREFIX = "llm-offload"


def check_nvme_path(path: str, need_bytes: int) -> None:
    """Before any rank starts: the folder exists, takes files, and has room for
    ``need_bytes`` (every rank of this host's files)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(
            f"parallelism.nvme_path={path} is not a folder; create it (on a local disk with "
            "room for the offloaded states) or point nvme_path at one"
        )
    try:  # a file made and removed: permissions, read-only mounts, root's limits alike
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"parallelism.nvme_path={path} takes no files ({exc.strerror}); fix its "
            "permissions or point nvme_path at a folder you can write"
        ) from None
    # Stale folders of crashed runs count as room: the ranks remove them when they start.
    free = free_bytes(folder) + sum(_size(f) for f in stale_folders(folder))
    if free < need_bytes:
        raise DiskFullError(no_space_for_states(folder, need_bytes))


def stale_folders(root: Path) -> list[Path]:
    """Folders of runs on this host whose process no longer exists."""
    host = socket.gethostname()
    out = []
    for folder in root.glob(f"{PREFIX}.{host}.*"):
        pid = folder.name.removeprefix(f"{PREFIX}.{host}.").split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            out.append(folder)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class RankFolder:
    """This rank's folder for the run, made at start (stale ones cleared first)."""

    def __init__(self, root: str) -> None:
        base = Path(root)
        for folder in stale_folders(base):
            shutil.rmtree(folder, ignore_errors=True)
        prefix = f"{PREFIX}.{socket.gethostname()}.{os.getpid()}."
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
