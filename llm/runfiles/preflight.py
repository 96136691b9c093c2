"""What train.py checks on its command line before Hydra runs (and writes anything): the
override keys, that the run directory can be made, and room on its disk.

Hydra answers a misspelt key (``train.max_stepz=5``) with advice to add ``+``, which would
add the typo, and a folder it cannot write (read-only for this user, a read-only mount, a
path under a file) or a disk already full with a PermissionError or OSError traceback from
its first write; these checks give one line each instead, before any folder exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException

from llm.config import Config, first_unknown_part, unknown_key_message
from llm.errors import ConfigError, DiskFullError
from llm.runfiles.disk import MB, free_bytes

CONF = Path(__file__).resolve().parents[2] / "conf"
MIN_FREE_BYTES = 1 * MB  # the run's record and logs; checkpoints are checked when written


def _overrides(argv: list[str]) -> list[str]:
    """The ``key=value`` arguments (Hydra's flags start with '-')."""
    return [a for a in argv if "=" in a and not a.startswith("-")]


def _all_keys(schema, prefix: str = "") -> list[str]:
    out = []
    for name, hint in typing.get_type_hints(schema).items():
        out.append(f"{prefix}{name}")
        if dataclasses.is_dataclass(hint):
            out += _all_keys(hint, f"{prefix}{name}.")
    return out


def _top_level_message(key: str) -> str:
    """A key with no dot that is neither a root field nor a config group."""
    keys = _all_keys(Config)
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}
    close = difflib.get_close_matches(key, list(by_leaf), n=1)
    hint = f"did you mean {by_leaf[close[0]]}? " if close else ""
    return f"{key} is not a config key or group; {hint}remove it or fix its name"


def check_override_keys(argv: list[str]) -> None:
    """ConfigError for the first plain ``key=value`` whose key the schema lacks. Keys
    added with ``+`` are checked after composition (llm.config.to_dataclass), Hydra's own
    (``hydra.*``, ``group/sub=...``, ``@package``) by Hydra."""
    try:
        parsed = OverridesParser.create().parse_overrides(_overrides(argv))
    except HydraException:
        return  # Hydra reports a malformed override itself
    for override in parsed:
        key = override.key_or_group
        if (
            override.type != OverrideType.CHANGE
            or override.package is not None
            or key.startswith("hydra")
            or "/" in key
        ):
            continue
        if "." not in key:
            fields = typing.get_type_hints(Config)
            if key not in fields and not (CONF / key).is_dir():
                raise ConfigError(_top_level_message(key))
            continue
        if (unknown := first_unknown_part(key)) is not None:
            raise ConfigError(unknown_key_message(unknown))


def run_root(argv: list[str]) -> Path:
    """The folder the run directory will be made in: hydra.run.dir's (hydra.sweep.dir's
    under -m) literal part, else conf/config.yaml's outputs/ (multirun/)."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    given = [a.removeprefix(key) for a in argv if a.startswith(key)]
    if given:
        return Path(given[-1].split("${", 1)[0] or ".")
    return Path("multirun" if multirun else "outputs")


def check_disk(argv: list[str]) -> None:
    """DiskFullError when the disk of the run directory has no room left to start."""
    root = run_root(argv)
    free = free_bytes(root)
    if free < MIN_FREE_BYTES:
        raise DiskFullError(
            f"no space left on the disk of {root} ({free / MB:.1f} MB free) to start a run; "
            "free space there or point hydra.run.dir at a disk with room"
        )


def check_run_dir_writable(argv: list[str]) -> None:
    """ConfigError when the run directory cannot be made: the folder it would be made in
    (its nearest existing ancestor) is not a folder, or this user cannot write there (a
    read-only folder or mount: access(2) answers both, and root's right to write anywhere)."""
    root = run_root(argv)
    existing = Path(os.path.abspath(root))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = "point hydra.run.dir (hydra.sweep.dir under -m) at a folder you can write"
    if not existing.is_dir():
        raise ConfigError(
            f"cannot make the run directory under {root}: {existing} is a file; {fix}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot make the run directory under {root}: {existing} is not writable (a "
            f"read-only folder or mount); {fix}, or make {existing} writable"
        )
