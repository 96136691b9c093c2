"""Checkpoints: atomic writes, pruning, corrupt and mismatched checkpoints, world-size change."""

from __future__ import annotations

import json

import pytest
import torch.distributed.checkpoint as dcp
from helpers import compose_config, small_run_overrides, train_losses

from llm.errors import CheckpointError
from llm.launch.launcher import launch
from llm.train import checkpoint as checkpoint_module


def overrides(out, text_corpus, cache_dir, *extra):
    return small_run_overrides(out, text_corpus, cache_dir, "checkpoint.every=2", *extra)


def steps_on_disk(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_every_and_keep_last(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    launch(compose_config(overrides(out, text_corpus, cache_dir, "checkpoint.keep_last=2")))
    # Saved at 2, 4 and the end (6); only the last two remain and no temporary folder.
    assert steps_on_disk(out) == ["step_000004", "step_000006"]
    meta = json.loads((out / "checkpoints/step_000006/meta.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 1


def test_failed_write_keeps_previous_checkpoint(tmp_path, text_corpus, cache_dir, monkeypatch):
    out = tmp_path / "run"
    launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=2")))
    assert steps_on_disk(out) == ["step_000002"]
    real_save = dcp.save

    def failing_save(state, **where):
        real_save(state, **where)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.dcp, "save", failing_save)
    cfg = compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=4"))
    with pytest.raises(CheckpointError, match="disk full"):
        launch(cfg)
    # The half-written step 4 never became a checkpoint; step 2 is whole and resumable.
    assert [p for p in steps_on_disk(out) if not p.startswith(".")] == ["step_000002"]
    monkeypatch.setattr(checkpoint_module.dcp, "save", real_save)
    summary = launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=4")))
    assert summary["steps"] == 4


def test_corrupt_checkpoint_names_the_previous_one(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=4")))
    newest = out / "checkpoints/step_000004"
    data_file = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated: a torn copy
    resume = overrides(
        out, text_corpus, cache_dir, "train.max_steps=6", f"checkpoint.resume={newest}"
    )
    with pytest.raises(CheckpointError, match="step_000002") as err:
        launch(compose_config(resume))
    assert "corrupt" in str(err.value) and "\n" not in str(err.value)
    previous = str(out / "checkpoints/step_000002")
    summary = launch(
        compose_config(
            overrides(
                out, text_corpus, cache_dir, "train.max_steps=6", f"checkpoint.resume={previous}"
            )
        )
    )
    assert summary["steps"] == 6


def test_unreadable_meta_is_refused(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=2")))
    (out / "checkpoints/step_000002/meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta\.json is unreadable"):
        launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=4")))


def test_mismatched_model_is_refused(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    launch(compose_config(overrides(out, text_corpus, cache_dir, "train.max_steps=2")))
    other = overrides(out, text_corpus, cache_dir, "train.max_steps=4", "model.n_layers=3")
    with pytest.raises(CheckpointError, match="different model shape"):
        launch(compose_config(other))


@pytest.mark.slow
def test_resume_on_another_world_size(tmp_path, text_corpus, cache_dir):
    """Saved by 2 DDP ranks, resumed by 1 process with the same global batch."""
    ref_out = tmp_path / "ref"
    launch(
        compose_config(
            small_run_overrides(ref_out, text_corpus, cache_dir, "train.micro_batch_size=8")
        )
    )
    out = tmp_path / "run"
    launch(
        compose_config(
            small_run_overrides(
                out,
                text_corpus,
                cache_dir,
                "parallelism=ddp",
                "launcher.nproc_per_node=2",
                "train.micro_batch_size=4",
                "train.stop_at_step=3",
            )
        )
    )
    launch(
        compose_config(small_run_overrides(out, text_corpus, cache_dir, "train.micro_batch_size=8"))
    )
    ref, got = train_losses(ref_out), train_losses(out)
    for step in range(1, 7):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
