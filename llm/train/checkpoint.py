"""Checkpoints: world-size-independent, atomic, checksummed, verified on load.

Layout of ``<run>/checkpoints/step_000100/``:
  model + optimizer   torch.distributed.checkpoint (DCP) files: sharded by rank on save,
                      resharded on load, so N ranks can save and M ranks resume
  trainer.pt          step, scheduler, data-loader position (global, not per rank)
  rng_rank{r}.pt      each rank's RNG states (restored when the world size matches)
  meta.json           written last: step, world size, model digest, the model's shape
                      (``model_args``) and tokenizer digest, and every file's size and
                      xxh3-64 checksum (each rank hashes the files it wrote)

A checkpoint is written into ``.step_000100.tmp`` and renamed into place only when complete,
so a failed write never touches the previous checkpoint; old ones are pruned only after the
rename. Before writing, the free space is compared with the checkpoint's size; a write that
fails removes its temporary folder, and a full disk is reported as one (llm.runfiles.disk).

Loading verifies meta.json and every file's size and checksum (the files shared out over
the ranks), then the model digest. ``checkpoint.resume=auto`` takes the newest checkpoint
that verifies and notes each newer one it skipped; checkpoints newer than the one a run
resumes from are moved to ``checkpoints/rolled_back/``, so neither ``auto`` nor pruning
mistakes them for the run's latest.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from llm.errors import CheckpointError, DiskFullError
from llm.parallel.dist import barrier, gather_object, global_rank, global_world_size
from llm.parallel.flat_shards import FlatShardLoadPlanner, FlatShardSavePlanner
from llm.runfiles.disk import free_bytes, no_space_message, says_no_space
from llm.train.bounded_writer import BoundedFileWriter
from llm.train.checkpoint_files import (
    META,
    PREFIX,
    TRAINER,
    checkpoint_bytes,
    file_problem,
    list_checkpoints,
    move_aside,
    own_files,
    read_meta,
    records_of,
    remove_stale_writes,
    rng_state,
    set_rng_state,
    skipped_line,
    state_bytes,
    step_of,
    write_meta,
)


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns on every save and load of one process without a process group, a mode it
    supports; the filter holds for those calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


# DCP's CheckpointException derives from BaseException; `except Exception` misses it.
SAVE_OR_LOAD_ERRORS = (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """One line for an exception; a CheckpointException by its first rank's failure (its
    own text is a multi-line traceback per rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank, (inner, _) = next(iter(failures.items()))
        return f"rank {rank}: {describe(inner)}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        keep_last: int,
        model_digest: str,
        world_size: int,
        file_bytes: int = 25 * 2**20,
        describes: dict | None = None,
    ):
        self.directory = Path(directory)
        # Written into every meta.json: what a reader needs without the run's config (the
        # model's shape and the tokenizer's digest: llm.inference.load).
        self.describes = describes or {}
        self.file_bytes = file_bytes
        self.keep_last = keep_last
        self.model_digest = model_digest
        self.world_size = world_size
        self.notes: list[str] = []  # one line per checkpoint resolve() skipped
        self._verified: set[Path] = set()

    # ---- saving ---------------------------------------------------------------------
    def save(self, step: int, strategy, trainer_state: dict) -> Path:
        final = self.directory / f"{PREFIX}{step:06d}"
        tmp = self.directory / f".{final.name}.tmp"
        state = strategy.state_dict()
        need = self._check_room(state)
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
            tmp.mkdir(parents=True)
        barrier()
        error, records = None, {}
        try:
            with single_process_quiet():
                dcp.save(
                    state,
                    storage_writer=BoundedFileWriter(tmp, self.file_bytes),
                    planner=FlatShardSavePlanner(),
                )
            torch.save(rng_state(), tmp / f"rng_rank{global_rank()}.pt")
            records = records_of(own_files(tmp, global_rank()))
        except SAVE_OR_LOAD_ERRORS as exc:
            error = exc
        why = None if error is None else describe(error)
        written = gather_object((why, says_no_space(error), records))
        outcome = None
        if global_rank() == 0:
            outcome, error = self._finish(tmp, final, step, trainer_state, written, error, need)
        outcome = gather_object(outcome)[0]  # rank 0's; also the barrier that ends the save
        if outcome is None:
            return final
        full, message = outcome
        raise (DiskFullError if full else CheckpointError)(message) from error

    def _check_room(self, state: dict) -> int:
        """The bytes a checkpoint needs (the newest one's size, else the state's tensors);
        refuses on every rank, before anything is written, when rank 0 sees less free."""
        rank0 = global_rank() == 0
        previous = list_checkpoints(self.directory) if rank0 else []
        facts = gather_object(
            (
                state_bytes(state, count_replicated=rank0),
                free_bytes(self.directory) if rank0 else 0,
                checkpoint_bytes(previous[-1]) if previous else 0,
            )
        )
        need = facts[0][2] or sum(f[0] for f in facts)
        if facts[0][1] < need:
            raise DiskFullError(self._no_space(need))
        return need

    def _finish(self, tmp, final, step, trainer_state, written, error, need):
        """Rank 0: write trainer.pt and meta.json, rename into place and prune; on any
        rank's failure remove the temporary folder instead. Returns (None, None) when the
        checkpoint is in place, else ((disk full?, one line), this rank's exception)."""
        failed = next((why for why, _, _ in written if why), None)
        no_space = any(full for _, full, _ in written)
        if failed is None:
            try:
                torch.save(trainer_state, tmp / TRAINER)
                files = {name: rec for _, _, recs in written for name, rec in recs.items()}
                files.update(records_of([p for p in tmp.iterdir() if p.name not in files]))
                meta = {
                    "step": step,
                    "world_size": self.world_size,
                    "model_digest": self.model_digest,
                    **self.describes,
                    "files": dict(sorted(files.items())),
                }
                write_meta(tmp, meta)
                self._replace(tmp, final)
                self._prune()
                return None, None
            except Exception as exc:
                error, failed, no_space = exc, describe(exc), says_no_space(exc)
        # Judged before the clean-up frees the partial write: a full disk has no room left.
        full = no_space or free_bytes(self.directory) < need
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            return (True, self._no_space(need)), error
        return (
            False,
            f"writing checkpoint {final} failed ({failed}); the earlier checkpoints are kept: "
            "fix the cause and run the same command to resume",
        ), error

    def _no_space(self, need: int) -> str:
        kept = list_checkpoints(self.directory)
        note = f" (the newest checkpoint, {kept[-1].name}, is kept)" if kept else ""
        return no_space_message(self.directory, "a checkpoint", need) + note

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

    # ---- choosing and verifying -----------------------------------------------------
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from: None for a fresh start. Every rank calls this."""
        if global_rank() == 0:
            remove_stale_writes(self.directory)  # safe: the run directory is locked
        barrier()
        if resume == "none":
            return None
        if resume == "auto":
            return self._newest_verified(self.directory, required=False)
        path = Path(resume)
        if (path / META).is_file() or step_of(path) >= 0:
            return path  # one checkpoint: load() verifies it
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        if list_checkpoints(folder):
            return self._newest_verified(folder, required=True)
        raise CheckpointError(
            f"checkpoint.resume={resume} holds no checkpoint; give a checkpoint folder "
            "(step_N, with meta.json), a run directory or its checkpoints/ folder, or "
            "auto / none"
        )

    def _newest_verified(self, folder: Path, required: bool) -> Path | None:
        found = list_checkpoints(folder)
        problems = []
        for candidate in reversed(found):
            problem = self.problem(candidate)
            if problem is None:
                self._verified.add(candidate)
                return candidate
            problems.append(problem)
            self.notes.append(skipped_line(candidate, problem))
        if found:
            raise CheckpointError(
                f"no checkpoint in {folder} verifies (the newest, {found[-1].name}: "
                f"{problems[0]}); start fresh with checkpoint.resume=none, or move {folder} aside"
            )
        if required:
            raise CheckpointError(f"{folder} holds no checkpoint")
        return None

    def problem(self, path: Path) -> str | None:
        """Why the checkpoint at ``path`` cannot be trusted, or None. Every rank calls this
        and gets the same answer: each checks the size and checksum of its share of the
        files."""
        meta, why = read_meta(path)
        if meta is None:
            return why
        names = sorted(meta["files"])
        mine = names[global_rank() :: global_world_size()]
        local = next((p for n in mine if (p := file_problem(path, n, meta["files"][n]))), None)
        found = [p for p in gather_object(local) if p]
        return found[0] if found else None

    # ---- loading --------------------------------------------------------------------
    def load(self, path: Path, strategy) -> dict:
        """Restore strategy state and RNG in place; return the trainer state."""
        if path not in self._verified and (problem := self.problem(path)):
            raise CheckpointError(self._unusable(path, problem))
        meta, _ = read_meta(path)
        if meta.get("model_digest") != self.model_digest:
            raise CheckpointError(
                f"checkpoint {path} holds a different model shape than this run's; resume with "
                "the model config it was saved with, or checkpoint.resume=none"
            )
        state = strategy.state_dict()  # the target layout; DCP fills it in place
        try:
            with single_process_quiet():
                dcp.load(state, checkpoint_id=str(path), planner=FlatShardLoadPlanner())
        except SAVE_OR_LOAD_ERRORS as exc:  # DCP raises many kinds; all mean unusable
            raise CheckpointError(self._unusable(path, describe(exc))) from exc
        strategy.load_state_dict(state)
        rng = path / f"rng_rank{global_rank()}.pt"
        # RNG streams belong to ranks; with another world size they cannot be matched up.
        if meta["world_size"] == self.world_size and rng.is_file():
            set_rng_state(self._torch_load(path, rng.name))
        return self._torch_load(path, TRAINER)

    def _torch_load(self, path: Path, name: str):
        try:
            return torch.load(path / name, weights_only=False)
        except Exception as exc:  # unpickling raises anything from EOFError to KeyError
            raise CheckpointError(self._unusable(path, f"{name}: {describe(exc)}")) from exc

    def _unusable(self, path: Path, why: str) -> str:
        step = step_of(path)
        earlier = [p for p in list_checkpoints(path.parent) if 0 <= step_of(p) < step]
        fix = (
            f"resume from the previous one with checkpoint.resume={earlier[-1]}"
            if earlier
            else "start fresh with checkpoint.resume=none"
        )
        return f"checkpoint {path} is corrupt: {why}; {fix}"

    def set_aside_newer(self, path: Path) -> Path | None:
        """Rank 0: move this run's checkpoints newer than ``path`` (the one resumed from) to
        ``rolled_back/``. They belong to the run as it was before this resume; left in place,
        ``auto`` would pick them next time and pruning would keep them over new ones."""
        if global_rank() != 0 or path.resolve().parent != self.directory.resolve():
            return None
        resumed = step_of(path)
        newer = [
            p for p in self.directory.glob(f"{PREFIX}*") if p.is_dir() and step_of(p) > resumed
        ]
        return move_aside(newer, self.directory) if newer else None
