"""The run directory at train.py's edges: one that cannot be made is refused before Hydra
writes anything, and a run refused after it started leaves no folder behind. Run
in-process through ``train.cli``; each docstring quotes the line the user sees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import small_run_overrides

from llm.errors import ConfigError
from llm.runfiles import preflight
from llm.runfiles.run_dir_lock import RunDirLock


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_an_unwritable_run_folder_is_one_line(train, capsys, tmp_path):
    """error: cannot make the run directory under DIR/run: DIR is not writable (a read-only
    folder or mount); point hydra.run.dir (hydra.sweep.dir under -m) at a folder you can
    write, or make DIR writable

    A chmod 0555 folder as hydra.run.dir's parent; where chmod does not stop this user
    (root), a path under a file stands in for a read-only mount (neither can be written)."""
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):  # root writes anyway
            parent = tmp_path / "a_file"
            parent.write_text("")
            why = f"{parent} is a file"
        else:
            why = f"{parent} is not writable (a read-only folder or mount)"
        target = parent / "run"
        assert train.cli(["train.max_steps=1", f"hydra.run.dir={target}"]) == 1
        (line,) = _lines(capsys)
        assert line.startswith(f"error: cannot make the run directory under {target}: {why}; ")
        assert "point hydra.run.dir" in line
        assert not target.exists() and not (tmp_path / "work" / "outputs").exists()
    finally:
        (tmp_path / "read_only").chmod(0o755)


def test_a_read_only_folder_is_named_with_its_fix(tmp_path, monkeypatch):
    """The answer of access(2) for a folder this user cannot write (what a read-only mount
    gives root too), asked without a mount: the nearest existing folder is named."""
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ConfigError) as exc:
        preflight.check_run_dir_writable([f"hydra.run.dir={tmp_path}/a/b/${{now:%H}}"])
    assert str(exc.value) == (
        f"cannot make the run directory under {tmp_path}/a/b: {tmp_path} is not writable (a "
        "read-only folder or mount); point hydra.run.dir (hydra.sweep.dir under -m) at a "
        f"folder you can write, or make {tmp_path} writable"
    )


def test_a_run_refused_after_it_started_leaves_no_folder(
    train, capsys, tmp_path, text_corpus, cache_dir
):
    """error: data.path=DIR/missing does not exist; point it at a file, folder or glob

    Refused once the launcher had taken the folder (its lock, .hydra/ and train.log
    written): the folder and the empty outputs/DATE above it are removed."""
    args = small_run_overrides(tmp_path, tmp_path / "missing", cache_dir)
    args = [a for a in args if not a.startswith("output_dir=")]
    assert train.cli(args) == 1
    line = _lines(capsys)[-1]
    assert line.startswith("error: ") and str(tmp_path / "missing") in line, line
    assert not (tmp_path / "work" / "outputs").exists()


def test_a_folder_with_a_live_lock_or_other_files_is_kept(tmp_path):
    from llm.launch.cli_report import remove_unused_run_dir

    run = tmp_path / "outputs" / "day" / "time"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("x: 1\n")
    (run / "train.log").write_text("refused\n")
    with RunDirLock(run):  # a live run took it meanwhile
        remove_unused_run_dir(run)
    assert (run / "train.log").is_file()
    (run / "metrics.jsonl").write_text("{}\n")
    remove_unused_run_dir(run)
    assert (run / "metrics.jsonl").is_file()
    (run / "metrics.jsonl").unlink()
    remove_unused_run_dir(run)
    assert not (tmp_path / "outputs").exists()
