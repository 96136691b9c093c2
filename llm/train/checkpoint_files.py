"""The files of a checkpoint folder: which exist, what meta.json records of them, what a
save leaves behind when it dies, and how big a checkpoint will be."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from llm.parallel.flat_shards import FlatShard
from llm.runfiles.checksum import file_record, mismatch

META = "meta.json"
TRAINER = "trainer.pt"
PREFIX = "step_"
ROLLED_BACK = "rolled_back"  # checkpoints newer than the one a run resumed from


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_of(path: Path) -> int:
    """N of a ``step_N`` checkpoint folder; -1 for any other name."""
    match = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (meta.json present), oldest first."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.glob(f"{PREFIX}*")
        if step_of(p) >= 0 and p.is_dir() and (p / META).is_file()
    ]
    return sorted(found, key=step_of)


def skipped_line(path: Path, problem: str) -> str:
    """What a reader says of a corrupt checkpoint it passed over for an older one (training's
    resume=auto and python -m llm.generate say it alike)."""
    return f"skipped checkpoint {path}: it is corrupt ({problem}); trying the one before it"


def own_files(folder: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote into a checkpoint folder: its RNG states and its DCP
    data files, which DCP names ``__{rank}_{i}.distcp``."""
    return [
        p
        for p in folder.iterdir()
        if p.name.startswith(f"__{rank}_") or p.name == f"rng_rank{rank}.pt"
    ]


def records_of(paths: list[Path]) -> dict[str, dict]:
    return {p.name: file_record(p) for p in sorted(paths)}


def write_meta(folder: Path, meta: dict) -> None:
    with open(folder / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta(folder: Path) -> tuple[dict | None, str | None]:
    """(meta.json's content, None), or (None, why it cannot be read)."""
    if not (folder / META).is_file():
        return None, "meta.json is missing (an unfinished write)"
    try:
        meta = json.loads((folder / META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"meta.json is unreadable ({exc})"
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return None, "meta.json lists no files"
    return meta, None


def file_problem(folder: Path, name: str, record: dict | int) -> str | None:
    """Why ``folder/name`` is not what meta.json recorded; None when it is."""
    # Checkpoints written before checksums were recorded give the size alone.
    return mismatch(folder / name, record if isinstance(record, dict) else {"bytes": record})


def state_bytes(state: dict, count_replicated: bool) -> int:
    """Bytes of the tensors one rank contributes to a checkpoint: its shards (DTensor,
    FlatShard), and whole tensors only when ``count_replicated`` (DCP writes a tensor
    every rank holds once, so only one rank should count it)."""
    total = 0
    for leaf in tree_leaves(state):
        if isinstance(leaf, DTensor):
            total += leaf.to_local().nbytes
        elif isinstance(leaf, FlatShard) or (isinstance(leaf, torch.Tensor) and count_replicated):
            total += leaf.nbytes
    return total


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def remove_stale_writes(directory: Path) -> None:
    """Clear what a killed save left: ``.step_N.tmp`` folders (never complete) are removed;
    a ``.step_N.old`` folder whose ``step_N`` is missing is the only whole copy of that step
    (a kill between the two renames of a re-save) and is put back. Only safe while this run
    holds the run-directory lock: no other save is in flight."""
    if not directory.is_dir():
        return
    for old in directory.glob(f".{PREFIX}*.old"):
        final = directory / old.name[1:].removesuffix(".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(final)
    for tmp in directory.glob(f".{PREFIX}*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def move_aside(folders: list[Path], directory: Path) -> Path:
    """Move checkpoint folders into ``directory/rolled_back/`` (a name already there gets a
    numbered suffix); returns that folder."""
    target = directory / ROLLED_BACK
    target.mkdir(exist_ok=True)
    for folder in folders:
        dest, n = target / folder.name, 1
        while dest.exists():
            dest, n = target / f"{folder.name}.{n}", n + 1
        folder.rename(dest)
    return target
