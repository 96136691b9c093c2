"""Faults of the configuration: each is refused (or warned about) with one line naming the
problem and the fix, before any rank starts. Each docstring quotes the line."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import CONF, compose_config, one_line
from hydra.errors import MissingConfigException

from llm.errors import ConfigError, TrainingError
from llm.parallel.step import overflow_checked_step
from llm.precision import disabled_loss_scaler
from llm.validate import validate

BASE = ["output_dir=/tmp/unused"]


# --- config ------------------------------------------------------------------------------


def test_a_key_added_with_plus_must_exist():
    """error: train.max_stepz is not a config key; did you mean train.max_steps? remove it
    or fix its name (keys of train: max_steps, ...)"""
    with pytest.raises(ConfigError, match=r"did you mean train\.max_steps") as err:
        compose_config([*BASE, "+train.max_stepz=5"])
    assert one_line(err).startswith("train.max_stepz is not a config key")
    with pytest.raises(ConfigError, match="nonsense is not a config key"):
        compose_config([*BASE, "+nonsense=1"])


def test_schemas_are_not_group_options():
    """Hydra: Could not find 'model/model_schema' (the list of models no longer offers it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with pytest.raises(MissingConfigException, match="model_schema"):
        compose_config([*BASE, "model=model_schema"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in ("model", "parallelism", "precision", "data", "launcher"):
            options = loader.get_group_options(group)
            assert options and not [o for o in options if o.endswith("_schema")], group


def test_cpu_ranks_far_beyond_the_cores_are_refused(monkeypatch, caplog):
    """error: launcher.nproc_per_node=64 CPU ranks on 2 usable core(s) would crawl ...; use
    at most 2 ranks, or insist with launcher.allow_oversubscribe=true"""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    ddp = [*BASE, "parallelism=ddp", "train.device=cpu"]
    with pytest.raises(ConfigError, match="64 CPU ranks on 2 usable core") as err:
        validate(compose_config([*ddp, "launcher.nproc_per_node=64"]))
    assert "launcher.allow_oversubscribe=true" in one_line(err)
    with caplog.at_level(logging.WARNING):
        validate(compose_config([*ddp, "launcher.nproc_per_node=4"]))
        validate(
            compose_config(
                [*ddp, "launcher.nproc_per_node=64", "launcher.allow_oversubscribe=true"]
            )
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("share 2 usable core(s)" in w for w in warnings)


def test_fp32_overflow_stop_speaks_of_no_loss_scale():
    """error: gradients were not finite 3 steps in a row in: w; lower optimizer.lr, keep
    train.grad_clip > 0, or check the data for extreme values"""
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), float("nan"))
    scaler = disabled_loss_scaler(max_overflows_at_min_scale=3)
    for _ in range(2):
        assert overflow_checked_step(
            [weight.grad], 1.0, scaler, lambda: None, lambda: ["w"], torch.device("cpu"), 1
        ).skipped
    with pytest.raises(TrainingError, match="not finite 3 steps in a row in: w") as err:
        overflow_checked_step(
            [weight.grad], 1.0, scaler, lambda: None, lambda: ["w"], torch.device("cpu"), 1
        )
    assert "loss scale" not in one_line(err)
