"""The ds_config parallelism=deepspeed hands to DeepSpeed: built from our groups, or a user's
file with its "auto" values filled from ours; what DeepSpeed cannot express or a file that
contradicts ours is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from llm.errors import ConfigError
from llm.parallel.ds_config import build_ds_config, checked_ds_config
from llm.precision import resolve_precision

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def ds_config(*overrides: str, precision: str = "fp32") -> dict:
    """The ds_config a 2-rank CPU run of a d_model=64 model would hand to DeepSpeed."""
    cfg = compose_config(["output_dir=/tmp/unused", "parallelism=deepspeed", *overrides])
    return build_ds_config(cfg, 2, resolve_precision(precision, CPU), False, d_model=64)


def test_gradients_are_reduced_in_our_reduce_dtype():
    assert ds_config(precision="bf16")["communication_data_type"] == "fp32"
    cfg = compose_config(["output_dir=/tmp/unused", "parallelism=deepspeed"])
    bf16_reduce = resolve_precision("bf16", CPU, reduce_dtype="bf16")
    assert build_ds_config(cfg, 2, bf16_reduce, False, d_model=64)["communication_data_type"] == (
        "bf16"
    )


def user_file(tmp_path: Path, content) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return f"parallelism.deepspeed_config={path}"


def test_generated_config_carries_our_groups():
    ds = ds_config(
        "train.micro_batch_size=4",
        "train.grad_accum_steps=3",
        "train.grad_clip=0.5",
        "optimizer.lr=1e-3",
        "optimizer.weight_decay=0.05",
        "parallelism.zero_stage=3",
        "parallelism.bucket_cap_mb=1",
        "parallelism.offload_optimizer=true",
        "parallelism.offload_params=true",
    )
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2 and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {
        "type": "AdamW",
        # Offloaded optimizer states are stepped by DeepSpeed's CPU Adam, not torch's.
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.05,
            "torch_adam": False,
        },
    }
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 2**20 // 4  # elements
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert zero["stage3_param_persistence_threshold"] == 640  # Hugging Face's 10 * hidden
    assert not ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    # The comms logger syncs after every collective: on only when counting is asked for.
    assert not ds["comms_logger"]["enabled"]
    assert ds_config("parallelism.count_comm=true")["comms_logger"]["enabled"]
    # Optimizers DeepSpeed does not build are handed over as client optimizers.
    assert "optimizer" not in ds_config("optimizer=sgd")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            (),
            dict(
                loss_scale=0,
                initial_scale_power=16,
                loss_scale_window=1000,
                hysteresis=2,
                min_loss_scale=1,
            ),
        ),
        (("precision.loss_scaler=megatron",), dict(initial_scale_power=32, hysteresis=2)),
        (
            ("precision.loss_scaler=torch",),
            dict(loss_scale_window=2000, hysteresis=1, min_loss_scale=0),
        ),
        (("precision.static_loss_scale=128",), dict(loss_scale=128)),
        (
            ("precision.hysteresis=4", "precision.consecutive_hysteresis=true"),
            dict(hysteresis=4, consecutive_hysteresis=True),
        ),
    ],
)
def test_fp16_section_follows_our_loss_scaler(overrides, expected):
    fp16 = ds_config("precision=fp16", *overrides, precision="fp16")["fp16"]
    assert fp16["enabled"] and not ds_config()["fp16"]["enabled"]
    assert {k: fp16[k] for k in expected} == expected


def test_loss_scale_deepspeed_cannot_express_is_refused():
    with pytest.raises(ConfigError, match="power of two"):
        ds_config("precision=fp16", "precision.initial_scale=1000", precision="fp16")
    with pytest.raises(ConfigError, match="doubles and halves"):
        ds_config("precision=fp16", "precision.growth_factor=4", precision="fp16")


def test_user_config_auto_values_are_filled_from_ours():
    example = REPO / "examples" / "ds_config.json"
    ds = ds_config(
        f"parallelism.deepspeed_config={example}",
        "parallelism.zero_stage=3",
        "train.micro_batch_size=2",
        "optimizer.lr=5e-4",
        precision="bf16",
    )
    assert "auto" not in json.dumps(ds)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["train_batch_size"] == 4
    assert ds["optimizer"]["params"]["lr"] == 5e-4 and ds["bf16"]["enabled"]
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    # The user's own settings are kept; what we measure with is added.
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 10**9
    assert not ds["comms_logger"]["enabled"]
    # Below stage 3 the stage-3 "auto" keys are left out: DeepSpeed's defaults apply.
    low = ds_config(f"parallelism.deepspeed_config={example}", "parallelism.zero_stage=1")
    assert "stage3_prefetch_bucket_size" not in low["zero_optimization"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"train_micro_batch_size_per_gpu": 8},
            "train_micro_batch_size_per_gpu=8 but train.micro_batch_size gives 4",
        ),
        (
            {"zero_optimization": {"stage": 3}},
            "zero_optimization.stage=3 but parallelism.zero_stage gives 2",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            "optimizer.params.lr=0.1 but optimizer.lr",
        ),
        ({"bf16": {"enabled": True}}, "bf16.enabled=True but precision gives False"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler section"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type=Lamb"),
    ],
)
def test_contradicting_user_config_is_refused(tmp_path, content, message):
    with pytest.raises(ConfigError, match=message) as err:
        ds_config(user_file(tmp_path, content), "train.micro_batch_size=4")
    assert "\n" not in str(err.value) and "set such values to" in str(err.value)


def test_missing_or_invalid_user_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ds_config(f"parallelism.deepspeed_config={tmp_path / 'nope.json'}")
    with pytest.raises(ConfigError, match="is not valid JSON") as err:
        ds_config(user_file(tmp_path, '{"train_batch_size": '))
    assert "\n" not in str(err.value)


def test_cpu_adam_that_cannot_build_is_one_line(monkeypatch):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    from llm.parallel import deepspeed as ds_strategy

    def failing_build(self, verbose=False):
        raise RuntimeError("Error building extension 'cpu_adam'\n<compiler log>")

    monkeypatch.setattr(CPUAdamBuilder, "load", failing_build)
    with pytest.raises(ConfigError, match=r"did not build \(Error building extension") as err:
        ds_strategy._require_cpu_adam()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "precision", "message"),
    [
        (("precision=bf16_pure",), "bf16_pure", "not mapped onto DeepSpeed"),
        (("precision=fp16",), "fp16", "no fp16 on CPU"),
        (("parallelism.zero_stage=0", "precision=bf16"), "bf16", "zero_stage>=1 or ddp"),
        (("train.compile=true",), "fp32", "train.compile=true"),
    ],
)
def test_what_deepspeed_cannot_run_here_is_refused(overrides, precision, message):
    cfg = compose_config(["output_dir=/tmp/unused", "parallelism=deepspeed", *overrides])
    with pytest.raises(ConfigError, match=message):
        checked_ds_config(cfg, resolve_precision(precision, CPU), CPU, 2, d_model=64)
