"""File checksums for what the run must trust on disk: checkpoints and token caches.

xxh3-64 (the ``xxhash`` package) reads at memory speed, so verifying a file costs about
what reading it does; it detects corruption, not tampering.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

ALGORITHM = "xxh3_64"
_CHUNK = 16 << 20


def file_checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict:
    """What a manifest keeps of one file: its size and checksum."""
    return {"bytes": path.stat().st_size, ALGORITHM: file_checksum(path)}


def mismatch(path: Path, record: dict) -> str | None:
    """Why ``path`` is not the file ``record`` describes (missing, another size, another
    checksum), or None when it is. The size is compared first: it costs no read."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{path.name} has {size} bytes, {record['bytes']} were written"
    # Checkpoints written before checksums were recorded carry the size alone.
    if ALGORITHM in record and file_checksum(path) != record[ALGORITHM]:
        return f"{path.name} does not match its {ALGORITHM} checksum"
    return None
