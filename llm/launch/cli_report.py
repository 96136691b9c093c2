"""What train.py tells a person when a run or a sweep ends, and the folder a refused
config must not leave behind. Lines go to stderr, unwrapped (paths are copied from them),
and to the run's train.log (llm.logging.say)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llm.errors import ConfigError
from llm.logging import say
from llm.runfiles.run_dir_lock import LOCK_FILE, RunDirLock
from llm.runfiles.run_record import RECORD_DIR
from llm.train.checkpoint_files import list_checkpoints


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _wandb_line(summary: dict) -> str | None:
    run = summary.get("wandb")
    if not run:
        return None
    folder = Path(run["dir"])
    folder = folder.parent if folder.name == "files" else folder
    if folder.name.startswith("offline-run"):
        return f"W&B: ran offline; upload with: wandb sync {folder}"
    return f"W&B: run {run['id']} (online), files in {folder}"


def print_run_end(summary: dict, output_dir: Path) -> None:
    """The run's last lines: its steps and final losses, where summary.json and the newest
    checkpoint are, and how the W&B run is reached (summary.json names it)."""
    written = output_dir / "summary.json"
    summary = json.loads(written.read_text()) if written.exists() else summary
    say(
        f"done: {summary.get('steps')} steps; final train loss "
        f"{_loss(summary.get('final_train_loss'))}, val loss {_loss(summary.get('final_val_loss'))}"
    )
    say(f"  summary: {output_dir / 'summary.json'}")
    found = list_checkpoints(output_dir / "checkpoints")
    say(f"  checkpoint: {found[-1] if found else 'none (checkpoint.enabled=false)'}")
    if line := _wandb_line(summary):
        say(f"  {line}")


def print_sweep_table(jobs: list[dict]) -> None:
    """One row per job of a sweep: its status, final losses, overrides and folder."""
    say(f"sweep: {len(jobs)} jobs")
    rows = [("job", "status", "train loss", "val loss", "overrides", "folder")]
    for i, job in enumerate(jobs):
        s = job.get("summary") or {}
        status = "done" if job.get("summary") else job.get("status", "not finished")
        rows.append(
            (
                str(i),
                status.split(":", 1)[0],
                _loss(s.get("final_train_loss")),
                _loss(s.get("final_val_loss")),
                job["overrides"] or "-",
                str(job["dir"]),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    for r in rows:
        say("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[-1])


def remove_unused_run_dir(run_dir: Path, levels: int = 3) -> None:
    """Remove ``run_dir`` when a refused run left nothing in it but what starting wrote:
    Hydra's log of the job (hydra/job_logging's ``<job name>.log``), and, when it was
    refused after the launcher took the folder (a corpus that cannot be read, say), the run
    record (``.hydra/``) and the lock file. Then its parents up to ``levels`` that are left
    empty (outputs/DATE/TIME). A folder with anything else in it (an earlier run's files, a
    rank's failure record) is kept, and so is one whose lock a live run holds."""
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir() or not all(_left_by_starting(e) for e in run_dir.iterdir()):
        return
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
    except ConfigError:  # a live run started there meanwhile: its folder
        return
    try:
        shutil.rmtree(run_dir)
    finally:
        lock.release()
    parent = run_dir.parent
    for _ in range(levels - 1):
        if parent == Path.cwd() or not parent.is_dir() or any(parent.iterdir()):
            return
        parent.rmdir()
        parent = parent.parent


def _left_by_starting(entry: Path) -> bool:
    if entry.name == RECORD_DIR:
        return entry.is_dir() and all(f.is_file() for f in entry.iterdir())
    return entry.is_file() and (entry.name == LOCK_FILE or entry.suffix == ".log")
