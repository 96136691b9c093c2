"""A signal at any moment of a run loses no completed step: SIGTERM (or Ctrl-C) injected at
start-up, in a step, in an evaluation, in a checkpoint write, in the final evaluation, in
the final save and at shutdown. Each ends in a checkpoint no older than the last completed
step, raises Interrupted with the shell's code for that signal, and train.py prints its one
line. The signal is sent from inside the moment (a wrapped function), not after a sleep.

    stopped: terminated (SIGTERM); the newest checkpoint is DIR/checkpoints/step_000006:
    run the same command to resume from it          (train.py exits 143)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import compose_config, one_line, small_run_overrides

from llm.errors import Interrupted
from llm.launch.launcher import launch
from llm.train.checkpoint import Checkpointer
from llm.train.checkpoint_files import list_checkpoints
from llm.train.trainer import Trainer

MAX_STEPS = 6


def _send(sig=signal.SIGTERM) -> None:
    os.kill(os.getpid(), sig)  # the handler runs at once, in this (the main) thread


def _signal_during(monkeypatch, owner, name: str, when=lambda call: True, sig=signal.SIGTERM):
    """Wrap ``owner.name`` so that the call(s) ``when`` picks (by 1-based call number) send
    ``sig`` in the middle of their work."""
    real = getattr(owner, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if when(len(calls)):
            _send(sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def _run(tmp_path, text_corpus, cache_dir, *extra):
    out = tmp_path / "run"
    cfg = compose_config(
        small_run_overrides(
            out, text_corpus, cache_dir, f"train.max_steps={MAX_STEPS}", "train.log_every=1",
            "train.eval_every=2", *extra,
        )
    )  # fmt: skip
    with pytest.raises(Interrupted) as err:
        launch(cfg)
    return out, err


def _newest_step(out: Path) -> int | None:
    found = list_checkpoints(out / "checkpoints")
    return int(found[-1].name.split("_")[1]) if found else None


def _completed_steps(out: Path) -> int:
    rows = (
        (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    )
    return sum('"loss"' in r for r in rows)


def _check_stopped(out, err, at_least: int | None):
    line = one_line(err)
    assert err.value.exit_code == 143
    if at_least is None:
        assert _newest_step(out) is None
        assert line == "terminated (SIGTERM) before any checkpoint was written; nothing to resume"
        return
    newest = _newest_step(out)
    assert newest is not None and newest >= at_least
    assert newest >= _completed_steps(out)  # no completed step is lost
    assert line.startswith("terminated (SIGTERM); the newest checkpoint is ")
    assert line.endswith(f"step_{newest:06d}: run the same command to resume from it")
    checker = Checkpointer(out / "checkpoints", 2, "", 1)
    assert checker.problem(out / "checkpoints" / f"step_{newest:06d}") is None


def test_at_start_up(tmp_path, text_corpus, cache_dir, monkeypatch):
    from llm import run

    _signal_during(monkeypatch, run, "build_model_for")
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=None)
    assert _completed_steps(out) == 0  # it stopped before training


def test_in_a_step(tmp_path, text_corpus, cache_dir, monkeypatch):
    _signal_during(monkeypatch, Trainer, "train_step", when=lambda n: n == 3)
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=3)


def test_in_an_evaluation(tmp_path, text_corpus, cache_dir, monkeypatch):
    _signal_during(monkeypatch, Trainer, "evaluate", when=lambda n: n == 1)  # at step 2
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=2)


def test_in_a_checkpoint_write(tmp_path, text_corpus, cache_dir, monkeypatch):
    _signal_during(monkeypatch, Checkpointer, "save", when=lambda n: n == 1)  # at step 2
    out, err = _run(tmp_path, text_corpus, cache_dir, "checkpoint.every=2")
    _check_stopped(out, err, at_least=2)


def test_in_the_final_evaluation(tmp_path, text_corpus, cache_dir, monkeypatch):
    # evaluate runs at steps 2 and 4 (eval_every), then once more after the last step.
    _signal_during(monkeypatch, Trainer, "evaluate", when=lambda n: n == 3)
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=MAX_STEPS)


def test_in_the_final_save(tmp_path, text_corpus, cache_dir, monkeypatch):
    _signal_during(monkeypatch, Checkpointer, "save")  # the only save: the final one
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=MAX_STEPS)


def test_at_shutdown(tmp_path, text_corpus, cache_dir, monkeypatch):
    from llm.logging import NullLogger, RunLogger

    for logger in (RunLogger, NullLogger):
        _signal_during(monkeypatch, logger, "close")  # after summary.json is written
    out, err = _run(tmp_path, text_corpus, cache_dir)
    _check_stopped(out, err, at_least=MAX_STEPS)
    assert (out / "summary.json").is_file()


def test_ctrl_c_at_the_end_says_interrupted(tmp_path, text_corpus, cache_dir, monkeypatch):
    """stopped: interrupted (Ctrl-C); the newest checkpoint is ... (exit 130)"""
    _signal_during(monkeypatch, Checkpointer, "save", sig=signal.SIGINT)
    out, err = _run(tmp_path, text_corpus, cache_dir)
    assert err.value.exit_code == 130
    assert one_line(err).startswith("interrupted (Ctrl-C); the newest checkpoint is ")
    assert _newest_step(out) == MAX_STEPS
