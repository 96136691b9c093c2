"""Longer runs (`make test-slow`): the default training learns; 4-rank DDP matches 1 process."""

from __future__ import annotations

import math

import pytest
from helpers import compose_config, small_run_overrides, train_losses

from llm.launch.launcher import launch
from llm.validate import validate

pytestmark = pytest.mark.slow


def test_default_training_learns(tmp_path, cache_dir):
    """The `make train` configuration, shortened: validation loss falls far below chance."""
    cfg = compose_config(
        [
            f"output_dir={tmp_path}",
            "logger=none",
            f"data.cache_dir={cache_dir}",
            "train.max_steps=150",
        ]
    )
    validate(cfg)
    summary = launch(cfg)
    chance = math.log(cfg.data.vocab_size)  # a uniform guess over the vocabulary
    assert summary["final_val_loss"] < 0.6 * chance


def test_ddp_four_ranks_equals_single_process(tmp_path, text_corpus, cache_dir):
    steps = ("train.max_steps=10",)
    run_single = tmp_path / "single"
    launch(
        compose_config(
            small_run_overrides(
                run_single, text_corpus, cache_dir, "train.micro_batch_size=8", *steps
            )
        )
    )
    run_ddp = tmp_path / "ddp"
    launch(
        compose_config(
            small_run_overrides(
                run_ddp,
                text_corpus,
                cache_dir,
                "parallelism=ddp",
                "launcher.nproc_per_node=4",
                "train.micro_batch_size=2",
                *steps,
            )
        )
    )
    ref, got = train_losses(run_single), train_losses(run_ddp)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
