"""The edges of a run as a person meets them at train.py's command line, run in-process
through ``train.cli`` (what ``python train.py ARGS`` runs). Each docstring quotes the line
the user sees."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
from helpers import small_run_overrides
from rich.console import Console

from llm.runfiles.run_dir_lock import RunDirLock
from llm.train.checkpoint import Checkpointer
from llm.train.checkpoint_files import list_checkpoints


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_plain_key_typo_gets_did_you_mean(train, capsys, tmp_path):
    """error: train.max_stepz is not a config key; did you mean train.max_steps? remove it
    or fix its name (keys of train: max_steps, ...)"""
    assert train.cli(["train.max_stepz=5"]) == 1
    line = _lines(capsys)[-1]
    assert line.startswith(
        "error: train.max_stepz is not a config key; did you mean train.max_steps?"
    )
    assert "+" not in line.split(";")[1]  # not Hydra's advice to add the typo with +
    assert train.cli(["max_steps=5"]) == 1
    assert "did you mean train.max_steps?" in _lines(capsys)[-1]
    assert not (tmp_path / "work" / "outputs").exists()


def test_a_disk_full_at_start_is_one_line(train, capsys, tmp_path, monkeypatch):
    """error: no space left on the disk of outputs (0.0 MB free) to start a run; free space
    there or point hydra.run.dir at a disk with room"""
    from llm.runfiles import preflight

    monkeypatch.setattr(preflight, "free_bytes", lambda directory: 0)
    assert train.cli(["train.max_steps=1"]) == 1
    (line,) = _lines(capsys)
    assert line.startswith("error: no space left on the disk of outputs (0.0 MB free)")
    assert not (tmp_path / "work" / "outputs").exists()


def test_a_refused_config_leaves_no_folder(train, capsys, tmp_path):
    """error: data.seq_len=100000 exceeds model gpt2-mini's max_seq_len=512; ..."""
    assert train.cli(["data.seq_len=100000", "logger=none"]) == 1
    assert _lines(capsys)[-1].startswith("error: data.seq_len=100000 exceeds")
    assert not (tmp_path / "work" / "outputs").exists()


def test_a_refused_second_run_leaves_the_live_runs_record(
    train, capsys, tmp_path, text_corpus, cache_dir
):
    """error: run directory DIR is in use by another run (PID N on host H); wait for it to
    finish or stop it, or give this run its own hydra.run.dir"""
    live = tmp_path / "live"
    record = live / ".hydra"
    record.mkdir(parents=True)
    (record / "config.yaml").write_text("optimizer:\n  lr: 0.001\n")
    (record / "overrides.yaml").write_text("- optimizer.lr=0.001\n")
    before = {p.name: p.read_text() for p in record.iterdir()}
    with RunDirLock(live):  # the live run holds its directory
        args = small_run_overrides(live, text_corpus, cache_dir, "optimizer.lr=0.5")
        args = [a for a in args if not a.startswith("output_dir=")]
        assert train.cli([*args, f"hydra.run.dir={live}"]) == 1
    assert "is in use by another run" in _lines(capsys)[-1]
    assert {p.name: p.read_text() for p in record.iterdir()} == before
    assert live.is_dir()  # a live run's folder is never removed


def _short_run(tmp_path, text_corpus, cache_dir, *extra) -> tuple[list[str], Path]:
    out = tmp_path / "run"
    args = small_run_overrides(out, text_corpus, cache_dir, *extra)
    return [a for a in args if not a.startswith("output_dir=")] + [f"hydra.run.dir={out}"], out


def test_a_run_ends_with_where_its_results_are(train, capsys, tmp_path, text_corpus, cache_dir):
    """done: 6 steps; final train loss 4.1234, val loss 4.2345
    summary: DIR/summary.json
    checkpoint: DIR/checkpoints/step_000006
    W&B: ran offline; upload with: wandb sync DIR/wandb/offline-run-..."""
    args, out = _short_run(tmp_path, text_corpus, cache_dir, "logger=wandb", "logger.mode=offline")
    assert train.cli(args) == 0
    lines = _lines(capsys)
    end = lines[[i for i, line in enumerate(lines) if line.startswith("done: ")][-1] :]
    assert end[0].startswith("done: 6 steps; final train loss ")
    assert end[1] == f"  summary: {out / 'summary.json'}"
    assert end[2] == f"  checkpoint: {out / 'checkpoints' / 'step_000006'}"
    (run,) = (out / "wandb").glob("offline-run-*")
    assert end[3] == f"  W&B: ran offline; upload with: wandb sync {run}"
    # The run's record is written (by us, once the lock is held).
    assert "train.max_steps=6" in (out / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_a_sweep_ends_with_a_table_of_its_jobs(train, capsys, tmp_path, text_corpus, cache_dir):
    """sweep: 2 jobs
    job  status  train loss  val loss  overrides        folder
    0    done    5.1234      5.2345    train.seed=1 ...  DIR/0"""
    args, _ = _short_run(tmp_path, text_corpus, cache_dir, "train.max_steps=2")
    args = [a for a in args if not a.startswith("hydra.run.dir=")]
    sweep = tmp_path / "sweep"
    assert train.cli(["-m", *args, "train.seed=1,2", f"hydra.sweep.dir={sweep}"]) == 0
    lines = _lines(capsys)
    start = lines.index("sweep: 2 jobs")
    rows = lines[start + 2 : start + 4]
    assert lines[start + 1].split()[:4] == ["job", "status", "train", "loss"]
    for i, row in enumerate(rows):
        assert row.split()[:2] == [str(i), "done"] and row.endswith(str(sweep / str(i)))
        assert f"train.seed={i + 1}" in row


def test_ctrl_c_is_acknowledged_and_a_second_stops_at_once(
    train, capfd, tmp_path, text_corpus, cache_dir, monkeypatch
):
    """Ctrl-C: stopping after this step; Ctrl-C again to stop now
    stopped: interrupted (Ctrl-C); the newest checkpoint is DIR/checkpoints/step_000002: run
    the same command to resume from it (stopped at once by a second Ctrl-C)   (exit 130)

    The second Ctrl-C lands in the middle of writing the step-4 checkpoint: that partial
    write is not a checkpoint, and step 2's stays the newest verified one."""
    from llm.train import checkpoint as checkpoint_module

    real_save = checkpoint_module.dcp.save
    saves = []

    def save(*a, **k):
        saves.append(1)
        if len(saves) == 2:  # the step-4 checkpoint
            os.kill(os.getpid(), signal.SIGINT)  # the first: acknowledged, the run goes on
            real_save(*a, **k)
            os.kill(os.getpid(), signal.SIGINT)  # the second, mid-write: stop now
        return real_save(*a, **k)

    monkeypatch.setattr(checkpoint_module.dcp, "save", save)
    args, out = _short_run(
        tmp_path, text_corpus, cache_dir, "checkpoint.every=2", "train.max_steps=8"
    )
    assert train.cli(args) == 130
    lines = _lines(capfd)
    assert "Ctrl-C: stopping after this step; Ctrl-C again to stop now" in lines
    assert lines[-1].startswith("stopped: interrupted (Ctrl-C); the newest checkpoint is ")
    assert lines[-1].endswith("(stopped at once by a second Ctrl-C)")
    assert "Traceback" not in "\n".join(lines)
    newest = list_checkpoints(out / "checkpoints")[-1]
    assert newest.name == "step_000002" and str(newest) in lines[-1]
    assert Checkpointer(out / "checkpoints", 2, "", 1).problem(newest) is None


def test_sigterm_is_acknowledged_once(capfd):
    """SIGTERM: stopping after this step"""
    from llm.train.stop import StopRequested

    with StopRequested(announce=True) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    assert capfd.readouterr().err == "SIGTERM: stopping after this step\n"
    assert stop.signal == "SIGTERM"


def test_paths_in_log_lines_are_not_wrapped(tmp_path):
    from llm.config import LoggerConfig
    from llm.logging import RunLogger

    out = io.StringIO()
    console = Console(file=out, width=40)
    logger = RunLogger(
        LoggerConfig(name="none", progress=False), tmp_path, {}, 10, "r", None, console
    )
    path = tmp_path / "a" / ("x" * 60) / "checkpoints" / "step_000002[1]"
    logger.info(f"saved checkpoint {path}")
    logger.alert(f"loss spiked; see {path}")
    logger.close()
    assert out.getvalue().splitlines() == [
        f"saved checkpoint {path}",
        f"alert: loss spiked; see {path}",
    ]
