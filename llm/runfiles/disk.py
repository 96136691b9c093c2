"""Free space, and recognising a full disk behind the errors writers raise.

A full disk does not always say so: ``torch.save`` reports it as "unexpected pos 704 vs
598" and torch.distributed.checkpoint wraps each rank's OSError in a CheckpointException,
so the errno is looked for through the chain, and the free space is asked as well.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

MB = 1 << 20


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (its
    nearest existing ancestor, when it is not made yet)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def says_no_space(exc: BaseException | None) -> bool:
    """Whether ENOSPC (or EDQUOT, a full quota) is anywhere in ``exc``: its errno, its
    cause or context, or a CheckpointException's per-rank failures."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exc, trace)}
        if isinstance(failures, dict):
            todo.extend(pair[0] for pair in failures.values())
        todo.extend((e.__cause__, e.__context__))
    return False


def no_space_message(directory: Path, what: str, need_bytes: int | None = None) -> str:
    """One line: where, how much is free, what was being written (and how much it needs
    when known), and the fix."""
    free = f"{free_bytes(directory) / MB:.0f} MB free"
    if need_bytes is None:
        where = f"({free}) for {what}"
    else:
        where = f"({free}, {what} needs about {need_bytes / MB:.0f} MB)"
    return (
        f"no space left on {directory} {where}; free space there or point hydra.run.dir at a "
        "disk with room, then run the same command to resume"
    )
