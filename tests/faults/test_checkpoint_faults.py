"""Faults of checkpoints and a full disk: corruption is caught by checksums at load, resume
skips or names what is bad, a full disk keeps every earlier checkpoint. Each docstring
quotes the line the user sees. The disk-full cases patch the writer (no tmpfs in tests)."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import compose_config, one_line, read_metrics, small_run_overrides

from llm.errors import CheckpointError, ConfigError, LabError, TrainingError
from llm.launch.launcher import launch
from llm.validate import validate

# --- checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_corpus, cache_dir):
    """A 4-step run with checkpoints at steps 2 and 4; tests work on copies of it."""
    out = tmp_path_factory.mktemp("faults") / "run"
    launch(compose_config(run_overrides(out, text_corpus, cache_dir, "train.max_steps=4")))
    return out


def run_overrides(out, text_corpus, cache_dir, *extra):
    return small_run_overrides(out, text_corpus, cache_dir, "checkpoint.every=2", *extra)


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def resume_run(out, text_corpus, cache_dir, *extra):
    cfg = compose_config(run_overrides(out, text_corpus, cache_dir, *extra))
    validate(cfg)
    return launch(cfg)


def flip_bytes_inside(path):
    """Same-size corruption: bits flipped in the middle, as a bad disk or copy leaves them."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def largest_data_file(checkpoint):
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def rewrite_checksum(checkpoint, name):
    """meta.json made to agree with a corrupted file (as if it were corrupted before being
    hashed), so that the load itself meets the corruption."""
    from llm.runfiles.checksum import file_record

    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = file_record(checkpoint / name)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_same_size_corruption_is_caught_at_load(run_copy, text_corpus, cache_dir):
    """error: checkpoint DIR/step_000004 is corrupt: __0_0.distcp does not match its xxh3_64
    checksum; resume from the previous one with checkpoint.resume=DIR/step_000002"""
    newest = run_copy / "checkpoints/step_000004"
    flip_bytes_inside(largest_data_file(newest))
    with pytest.raises(CheckpointError, match="does not match its xxh3_64 checksum") as err:
        resume_run(
            run_copy, text_corpus, cache_dir, "train.max_steps=6", f"checkpoint.resume={newest}"
        )
    assert f"checkpoint.resume={run_copy / 'checkpoints/step_000002'}" in one_line(err)


def test_load_errors_name_the_file(run_copy, text_corpus, cache_dir):
    """error: checkpoint DIR/step_000004 is corrupt: trainer.pt: UnpicklingError: ...;
    resume from the previous one with checkpoint.resume=DIR/step_000002
    (and DCP's CheckpointException, a BaseException, ends the same way)"""
    newest = run_copy / "checkpoints/step_000004"
    resume = ["train.max_steps=6", f"checkpoint.resume={newest}"]
    (newest / "trainer.pt").write_bytes(b"not a pickle" * 10)
    rewrite_checksum(newest, "trainer.pt")
    with pytest.raises(CheckpointError, match=r"step_000004 is corrupt: trainer\.pt: ") as err:
        resume_run(run_copy, text_corpus, cache_dir, *resume)
    assert "step_000002" in one_line(err)
    data_file = largest_data_file(newest)
    data = bytearray(data_file.read_bytes())
    for i in range(0, len(data), 997):  # through DCP's own record headers too
        data[i] ^= 0xFF
    data_file.write_bytes(bytes(data))
    rewrite_checksum(newest, data_file.name)
    with pytest.raises(CheckpointError, match="step_000004 is corrupt: rank 0: ") as err:
        resume_run(run_copy, text_corpus, cache_dir, *resume)
    one_line(err)


def test_auto_resume_skips_a_corrupt_newest_checkpoint(run_copy, text_corpus, cache_dir, capsys):
    """skipped checkpoint DIR/step_000004: it is corrupt (__0_0.distcp does not match its
    xxh3_64 checksum); trying the one before it
    (then metrics.jsonl holds each step once: rows after step 2 go to
    metrics.rolled_back.jsonl, the earlier summary.json to summary.previous.json)"""
    newest = run_copy / "checkpoints/step_000004"
    flip_bytes_inside(largest_data_file(newest))
    before = read_metrics(run_copy)
    assert resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=4")["steps"] == 4
    err = capsys.readouterr().err.replace("\n", "")
    assert f"skipped checkpoint {newest}: it is corrupt" in err
    assert "step_000002 at step 2" in err
    # The corrupt checkpoint is set aside, not deleted, and no longer the newest.
    assert (run_copy / "checkpoints/rolled_back/step_000004").is_dir()
    assert [m["step"] for m in read_metrics(run_copy) if "loss" in m] == [1, 2, 3, 4]
    side = (run_copy / "metrics.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in side] == [m for m in before if m["step"] > 2]
    assert (run_copy / "summary.previous.json").is_file()


def test_resume_from_a_run_directory(run_copy, text_corpus, cache_dir, capsys, tmp_path):
    """error: checkpoint.resume=DIR holds no checkpoint; give a checkpoint folder (step_N,
    with meta.json), a run directory or its checkpoints/ folder, or auto / none"""
    out = tmp_path / "next"
    summary = resume_run(
        out, text_corpus, cache_dir, "train.max_steps=5", f"checkpoint.resume={run_copy}"
    )
    assert summary["steps"] == 5
    assert "step_000004 at step 4" in capsys.readouterr().err.replace("\n", "")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint") as err:
        resume_run(out, text_corpus, cache_dir, f"checkpoint.resume={empty}")
    assert "or delete" not in one_line(err)


def test_nan_after_resume_names_the_checkpoint(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: loss is nan at step 5: ...; this run resumed from DIR/step_000004, which may
    hold the cause: resume from an earlier checkpoint (checkpoint.resume=PATH) or start
    fresh (checkpoint.resume=none)"""
    real = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan")
    )
    with pytest.raises(TrainingError, match="loss is nan at step 5") as err:
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=6")
    assert f"resumed from {run_copy / 'checkpoints/step_000004'}" in one_line(err)


# --- disk full ---------------------------------------------------------------------------


def test_disk_full_mid_write(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: no space left on DIR/checkpoints (N MB free, a checkpoint needs about M MB);
    free space there or point hydra.run.dir at a disk with room, then run the same command
    to resume (the newest checkpoint, step_000004, is kept)"""
    from llm.train import checkpoint as checkpoint_module

    real_save = dcp.save

    def save_until_full(*args, **kwargs):
        real_save(*args, **kwargs)  # a partial write takes up space
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_until_full)
    with pytest.raises(
        LabError,
        match=r"no space left on .*checkpoints \(\d+ MB free, a checkpoint needs about \d+ MB\)",
    ) as err:
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=5")
    assert "step_000004, is kept" in one_line(err)
    assert isinstance(err.value, OSError)
    left = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    assert left == ["step_000002", "step_000004"]  # no partial .step_000005.tmp
    checker = checkpoint_module.Checkpointer(run_copy / "checkpoints", 2, "", 1)
    assert checker.problem(run_copy / "checkpoints/step_000004") is None  # intact


def test_disk_full_is_found_before_writing(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: no space left on DIR/checkpoints (1 MB free, a checkpoint needs about M MB);
    ... (the newest checkpoint, step_000004, is kept)"""
    from llm.runfiles import disk
    from llm.train import checkpoint as checkpoint_module

    monkeypatch.setattr(disk, "free_bytes", lambda directory: 1 << 20)
    monkeypatch.setattr(checkpoint_module, "free_bytes", lambda directory: 1 << 20)
    with pytest.raises(LabError, match=r"\(1 MB free, a checkpoint needs about \d+ MB\)"):
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=5")
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004",
    ]
