"""What every corpus shares: a stable hash split into train and val, digests that change
when the documents could, and tolerant text reading."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` alone (Python's hash() is salted per process)."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def val_keys(keys: Sequence[str], val_fraction: float) -> set[str]:
    """The keys held out for validation: those whose stable fraction is below val_fraction,
    so each key's split never depends on the others. Small corpora could get no val key (or
    no train key) that way; then the lowest (highest) key moves over, so both splits exist."""
    ranked = sorted(keys, key=stable_fraction)
    held = {k for k in ranked if stable_fraction(k) < val_fraction}
    if len(ranked) >= 2 and not held:
        held = {ranked[0]}
    if len(ranked) >= 2 and len(held) == len(ranked):
        held.discard(ranked[-1])
    return held


def split_by_key(files: list[Path], keys: list[str], val_fraction: float) -> dict[str, list[Path]]:
    """Files split into train / val by their stable keys (relative paths), keeping order."""
    held = val_keys(keys, val_fraction)
    return {
        "train": [f for f, k in zip(files, keys, strict=True) if k not in held],
        "val": [f for f, k in zip(files, keys, strict=True) if k in held],
    }


def digest_of(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()


def file_stats(root: Path, files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime) per file: cheap to compute, and changes when a file does."""
    out = []
    for f in files:
        st = f.stat()
        out.append((f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return out


def read_text(path: Path) -> str:
    # A few stdlib test files hold deliberately invalid UTF-8; replacing keeps them usable.
    return path.read_text(encoding="utf-8", errors="replace")
