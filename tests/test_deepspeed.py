"""parallelism=deepspeed: the ds_config built from our groups (and a user's file with "auto"
values), ZeRO stages 1-3 on gloo against the single-process reference, what each rank holds
and sends, and resume across world sizes and ZeRO stages."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_close_weights,
    compose_config,
    final_weights,
    run,
    small_run_overrides,
    train_losses,
)

from llm.errors import ConfigError
from llm.launch import launch
from llm.parallel.ds_checkpoint import blocks
from llm.parallel.ds_config import build_ds_config
from llm.precision import resolve_precision

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
STEPS = ("train.max_steps=20", "train.log_every=1")
# A small reduce bucket (13,107 fp32 elements, a tenth of gpt2-tiny): several buckets per
# backward, so ZeRO-2/3's gradient memory is bucket + partition, not one bucket of everything.
BUCKET_MB = 0.05


def ds_config(*overrides: str, precision: str = "fp32", dp_size: int = 2) -> dict:
    cfg = compose_config(["output_dir=/tmp/unused", "parallelism=deepspeed", *overrides])
    return build_ds_config(cfg, dp_size, resolve_precision(precision, CPU), False, d_model=64)


def user_file(tmp_path: Path, content) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return f"parallelism.deepspeed_config={path}"


# ---- the ds_config ----------------------------------------------------------------------
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
    assert ds["comms_logger"]["enabled"]
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
    assert ds["comms_logger"]["enabled"]
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


@pytest.mark.parametrize("shape", [(7,), (5, 7), (3, 4, 5)])
def test_blocks_tile_a_flat_range_in_order(shape):
    """A rank's flat slice of a parameter becomes rectangles covering exactly that slice."""
    numel = math.prod(shape)
    flat = torch.arange(numel).view(shape)
    for a in range(numel):
        for b in range(a + 1, numel + 1):
            pieces = [
                flat[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
                for off, size in blocks(shape, a, b)
            ]
            assert torch.equal(torch.cat(pieces), torch.arange(a, b)), (a, b)


# ---- against the single-process reference -------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("ds_reference")
    summary, out = run(tmp, "single", text_corpus, cache_dir, "train.micro_batch_size=8", *STEPS)
    return summary, train_losses(out), final_weights(out)


def run_deepspeed(tmp_path, text_corpus, cache_dir, stage: int, ranks: int, *extra: str):
    return run(
        tmp_path,
        f"zero{stage}_{ranks}",
        text_corpus,
        cache_dir,
        "parallelism=deepspeed",
        f"parallelism.zero_stage={stage}",
        f"parallelism.bucket_cap_mb={BUCKET_MB}",
        f"launcher.nproc_per_node={ranks}",
        f"train.micro_batch_size={8 // ranks}",
        *STEPS,
        *extra,
    )


def check_against_reference(reference, summary, out) -> None:
    _, ref_losses, ref_weights = reference
    got = train_losses(out)
    assert sorted(got) == sorted(ref_losses) == list(range(1, 21))
    # As DDP: only the order fp32 gradients are summed differs (per-rank sums averaged by a
    # reduction vs one sum); measured at most 1.7e-7 relative on losses, 2.3e-6 absolute on
    # weights over 20 AdamW steps, for every stage at 2 and 4 ranks.
    for step, loss in ref_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step
    assert_close_weights(ref_weights, final_weights(out), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_two_ranks_equals_single_process(
    tmp_path, text_corpus, cache_dir, reference, stage
):
    summary, out = run_deepspeed(tmp_path, text_corpus, cache_dir, stage, 2)
    assert summary["world_size"] == 2 and summary["strategy"] == "deepspeed"
    check_against_reference(reference, summary, out)
    check_model_state_and_comm(reference[0], summary, stage, ranks=2)


def check_model_state_and_comm(single: dict, summary: dict, stage: int, ranks: int) -> None:
    """What DeepSpeed really holds and sends, against ZeRO's shapes (fp32 training: the
    working weights are fp32, so P = 4 bytes x parameters = the reference's params bytes)."""
    P = single["model_state_bytes"][0]["params"]
    bucket = int(BUCKET_MB * 2**20)
    for mem, sent in zip(summary["model_state_bytes"], summary["comm_bytes_per_step"], strict=True):
        # fp32 master partition + exp_avg + exp_avg_sq: 12 bytes x parameters / N, plus the
        # partition padding and the 4-byte step scalars.
        assert mem["optimizer_states"] == pytest.approx(3 * P / ranks, rel=1e-3)
        if stage < 3:
            # Every rank keeps all working weights; ZeRO-1 also the full gradients until the
            # boundary's reduction, ZeRO-2 only a partition plus the bucket being filled.
            assert mem["params"] == pytest.approx(P, rel=1e-3)
            if stage == 1:
                assert mem["grads"] == P
            else:
                assert P / ranks <= mem["grads"] <= P / ranks + 3 * bucket
            # One all-reduce of the gradients and one all-gather of the updated weights.
            assert sent["all_reduce"] == pytest.approx(P, rel=1e-3)
            assert sent["all_gather"] == pytest.approx(P, rel=1e-6)
        else:
            # Partitions of every parameter, plus the small ones kept whole (persistence
            # threshold 10 * d_model = 640 elements: norms and biases, 1.4% of gpt2-tiny).
            assert P / ranks <= mem["params"] <= 1.03 * P / ranks
            assert P / ranks <= mem["grads"] <= P / ranks + 3 * bucket
            assert sent["reduce_scatter"] == pytest.approx(P, rel=1e-6)
            # Parameters are gathered once per step (DeepSpeed keeps them for the backward of a
            # model this small: max_reuse_distance), not the ZeRO paper's twice.
            assert 0.95 * P <= sent["all_gather"] <= 2 * P


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_four_ranks_equals_single_process(
    tmp_path, text_corpus, cache_dir, reference, stage
):
    summary, out = run_deepspeed(tmp_path, text_corpus, cache_dir, stage, 4)
    check_against_reference(reference, summary, out)
    check_model_state_and_comm(reference[0], summary, stage, ranks=4)


def test_resume_across_world_size_and_stage(tmp_path, text_corpus, cache_dir, reference):
    """Saved by ZeRO-2 on 2 ranks, resumed by ZeRO-3 on 4: the checkpoint holds parameters
    and Adam moments by name at their own shapes, as every other strategy writes them."""
    out = tmp_path / "resumed"

    def launch_with(stage: int, ranks: int, *extra: str):
        ds = (f"parallelism.zero_stage={stage}", f"launcher.nproc_per_node={ranks}")
        cfg = compose_config(
            small_run_overrides(
                out,
                text_corpus,
                cache_dir,
                "parallelism=deepspeed",
                *ds,
                f"train.micro_batch_size={8 // ranks}",
                *STEPS,
                *extra,
            )
        )
        return launch(cfg)

    assert launch_with(2, 2, "train.stop_at_step=10")["steps"] == 10
    resumed = launch_with(3, 4)
    assert resumed["steps"] == 20 and resumed["world_size"] == 4
    check_against_reference(reference, resumed, out)


# ---- started by other launchers -------------------------------------------------------------
def cli_overrides(corpus: Path, cache: Path) -> list[str]:
    return [
        *small_run_overrides(Path("unused"), corpus, cache, "train.max_steps=3"),
        "parallelism=deepspeed",
        "parallelism.zero_stage=2",
    ][1:]  # output_dir: each rank's Hydra run directory, rank 0's wins


def single_summary(cwd: Path) -> dict:
    (summary,) = cwd.glob("outputs/*/*/summary.json")
    return json.loads(summary.read_text())


@pytest.mark.slow
def test_torchrun_environment_starts_deepspeed_ranks(tmp_path, text_corpus, cache_dir):
    """RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* from the launcher, as torchrun sets them."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(REPO / "train.py")]
    cmd += [*cli_overrides(text_corpus, cache_dir), "launcher=torchrun"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = single_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["strategy"] == "deepspeed"
    assert all(rank["all_gather"] > 0 for rank in summary["comm_bytes_per_step"])


@pytest.mark.slow
def test_deepspeed_launcher_on_cpu(tmp_path, text_corpus, cache_dir):
    """The real `deepspeed --num_gpus 2` runs CPU ranks (its accelerator falls back to CPU).
    --no_local_rank: it would otherwise append --local_rank=N, which Hydra refuses."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    cmd = [launcher, "--num_gpus", "2", "--no_local_rank", str(REPO / "train.py")]
    cmd += cli_overrides(text_corpus, cache_dir)
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = single_summary(tmp_path)
    assert summary["world_size"] == 2 and len(summary["model_state_bytes"]) == 2


@pytest.mark.slow
def test_zero3_offload_equals_single_process(tmp_path, text_corpus, cache_dir, reference):
    """ZeRO-3 with parameters and optimizer states in CPU memory, stepped by DeepSpeed's CPU
    Adam (JIT-built into TORCH_EXTENSIONS_DIR on first use: minutes on 2 cores)."""
    extra = ("parallelism.offload_optimizer=true", "parallelism.offload_params=true")
    summary, out = run_deepspeed(tmp_path, text_corpus, cache_dir, 3, 2, *extra)
    check_against_reference(reference, summary, out)
