"""Checkpoints: world-size-independent, atomic, verified on load.

Layout of ``<run>/checkpoints/step_000100/``:
  model + optimizer   torch.distributed.checkpoint (DCP) files: sharded by rank on save,
                      resharded on load, so N ranks can save and M ranks resume
  trainer.pt          step, scheduler, data-loader position (global, not per rank)
  rng_rank{r}.pt      each rank's RNG states (restored when the world size matches)
  meta.json           written last: step, world size, model digest, every file's size

A checkpoint is written into ``.step_000100.tmp`` and renamed into place only when complete,
so a failed write never touches the previous checkpoint; old ones are pruned only after the
rename. A checkpoint without meta.json, or whose files disagree with it, is refused on load
with the path of the previous one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from llm.dist import barrier, global_rank
from llm.errors import CheckpointError
from llm.train.bounded_writer import BoundedFileWriter

# One process without a process group is a supported DCP mode; its warning is noise here.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

META = "meta.json"
TRAINER = "trainer.pt"
PREFIX = "step_"


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


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (meta.json present), oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob(f"{PREFIX}*") if p.is_dir() and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix(PREFIX)))


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        keep_last: int,
        model_digest: str,
        world_size: int,
        file_bytes: int = 25 * 2**20,
    ):
        self.directory = Path(directory)
        self.file_bytes = file_bytes
        self.keep_last = keep_last
        self.model_digest = model_digest
        self.world_size = world_size

    def save(self, step: int, strategy, trainer_state: dict) -> Path:
        final = self.directory / f"{PREFIX}{step:06d}"
        tmp = self.directory / f".{final.name}.tmp"
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
            tmp.mkdir(parents=True)
        barrier()
        dcp.save(strategy.state_dict(), storage_writer=BoundedFileWriter(tmp, self.file_bytes))
        torch.save(rng_state(), tmp / f"rng_rank{global_rank()}.pt")
        barrier()
        if global_rank() == 0:
            torch.save(trainer_state, tmp / TRAINER)
            self._write_meta(tmp, step)
            self._replace(tmp, final)
            self._prune()
        barrier()
        return final

    def _write_meta(self, tmp: Path, step: int) -> None:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        meta = {
            "step": step,
            "world_size": self.world_size,
            "model_digest": self.model_digest,
            "files": files,
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _replace(tmp: Path, final: Path) -> None:
        # Re-saving a step (after a resume) swaps the old copy out only once the new is whole.
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)

    def _prune(self) -> None:
        for old in list_checkpoints(self.directory)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from: None for a fresh start."""
        if resume == "none":
            return None
        if resume != "auto":
            return Path(resume)
        found = list_checkpoints(self.directory)
        return found[-1] if found else None

    def load(self, path: Path, strategy) -> dict:
        """Restore strategy state and RNG in place; return the trainer state."""
        meta = self._verify(path)
        state = strategy.state_dict()  # the target layout; DCP fills it in place
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as exc:  # DCP raises many kinds; all mean this checkpoint is unusable
            raise CheckpointError(self._unusable(path, f"{type(exc).__name__}: {exc}")) from exc
        strategy.load_state_dict(state)
        rng = path / f"rng_rank{global_rank()}.pt"
        # RNG streams belong to ranks; with another world size they cannot be matched up.
        if meta["world_size"] == self.world_size and rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        return torch.load(path / TRAINER, weights_only=False)

    def _verify(self, path: Path) -> dict:
        if not (path / META).is_file():
            raise CheckpointError(
                self._unusable(path, "meta.json is missing (an unfinished write)")
            )
        try:
            meta = json.loads((path / META).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(self._unusable(path, f"meta.json is unreadable ({exc})")) from exc
        for name, size in meta.get("files", {}).items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise CheckpointError(
                    self._unusable(path, f"{name} has {actual} bytes, meta.json says {size}")
                )
        if meta.get("model_digest") != self.model_digest:
            raise CheckpointError(
                f"checkpoint {path} holds a different model shape than this run's; resume with "
                "the model config it was saved with, or checkpoint.resume=none"
            )
        return meta

    def _unusable(self, path: Path, why: str) -> str:
        earlier = [p for p in list_checkpoints(path.parent) if p != path and p.name < path.name]
        fix = (
            f"resume from the previous one with checkpoint.resume={earlier[-1]}"
            if earlier
            else "start fresh with checkpoint.resume=none"
        )
        return f"checkpoint {path} is corrupt: {why}; {fix}, or delete it"
