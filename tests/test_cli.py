"""End to end through `python train.py`: outputs, W&B offline run, errors, multirun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_metrics

from llm.launch.launcher import strip_launcher_args

REPO = Path(__file__).resolve().parent.parent


def train_cli(args, cwd, timeout=600, env_extra=None, **popen):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    cmd = [sys.executable, str(REPO / "train.py"), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, **popen)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def small(corpus, cache, *extra):
    return [
        "model=gpt2-tiny",
        "data=files",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "data.tokenizer=bpe",
        "data.vocab_size=300",
        "data.seq_len=64",
        "data.val_samples=8",
        "train.device=cpu",
        "train.micro_batch_size=4",
        "train.log_every=2",
        "scheduler.warmup_steps=1",
        *extra,
    ]


def test_run_writes_summary_metrics_and_wandb_offline(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    result = train_cli(
        small(
            text_corpus,
            cache_dir,
            "train.max_steps=6",
            "train.eval_every=3",
            f"hydra.run.dir={out}",
            "logger=wandb",
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "steps",
        "final_train_loss",
        "final_val_loss",
        "tokens_per_sec",
        "mfu",
        "mfu_causal",
        "peak_memory_bytes",
        "model_state_bytes",
        "comm_bytes_per_step",
        "world_size",
        "device",
        "git_sha",
        "config_digest",
    ):
        assert key in summary, key
    assert summary["steps"] == 6 and summary["world_size"] == 1 and summary["mfu"] is None
    assert summary["mfu_causal"] is None
    assert set(summary["model_state_bytes"][0]) == {"params", "grads", "optimizer_states"}
    assert (
        summary["model_state_bytes"][0]["optimizer_states"]
        > summary["model_state_bytes"][0]["params"]
    )
    metrics = read_metrics(out)
    logged = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in logged] == [1, 2, 4, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s"):
        assert all(key in m for m in logged), key
    assert [m["step"] for m in metrics if "val_loss" in m] == [3, 6]
    assert (out / ".hydra/config.yaml").is_file()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_bad_config_is_one_line_before_any_work(tmp_path):
    result = train_cli(["data.seq_len=100000", f"hydra.run.dir={tmp_path / 'x'}"], cwd=tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: data.seq_len=100000 exceeds model")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_multirun_two_jobs_of_two_ranks(tmp_path, text_corpus, cache_dir):
    sweep = tmp_path / "sweep"
    result = train_cli(
        [
            "-m",
            *small(
                text_corpus,
                cache_dir,
                "train.max_steps=3",
                "train.eval_every=100",
                "parallelism=ddp",
                "launcher.nproc_per_node=2",
                "optimizer=adamw,sgd",
                "logger=wandb",
                f"hydra.sweep.dir={sweep}",
            ),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["world_size"] for s in summaries] == [2, 2]
    # parallelism.count_comm is off by default: no figure, and the summary says why.
    assert all(s["comm_bytes_per_step"] == [None, None] for s in summaries)
    assert all("parallelism.count_comm=false" in s["comm_bytes_note"] for s in summaries)
    # Both jobs are W&B runs of one group named after the sweep; the offline run record
    # (protobuf, strings stored verbatim) carries that group.
    (group,) = {s["wandb"]["group"] for s in summaries}
    assert group == str(sweep).replace("/", "_")
    for i in (0, 1):
        (record,) = (sweep / str(i) / "wandb").glob("offline-run-*/run-*.wandb")
        assert group.encode() in record.read_bytes()


def test_sigterm_checkpoints_and_says_stopped(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "run"
    proc = train_cli(
        small(
            text_corpus,
            cache_dir,
            "train.max_steps=100000",
            "train.log_every=1",
            "train.eval_every=100000",
            "logger=none",
            f"hydra.run.dir={out}",
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and 3 <= summary["steps"] < 100000
    checkpoint = out / "checkpoints" / f"step_{summary['steps']:06d}"
    assert (checkpoint / "meta.json").is_file()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "SIGTERM: stopping after this step" in lines
    assert lines[-1] == (
        f"stopped: terminated (SIGTERM); the newest checkpoint is {checkpoint}: run the same "
        "command to resume from it"
    )


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_directory(tmp_path, text_corpus, cache_dir):
    """Under torchrun each rank runs Hydra itself; rank 0's run directory is the run's."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",  # a free port for the rendezvous
        "--nproc-per-node",
        "2",
        str(REPO / "train.py"),
        *small(
            text_corpus,
            cache_dir,
            "train.max_steps=3",
            "parallelism=ddp",
            "launcher=torchrun",
            "logger=none",
        ),
    ]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (summary_file,) = tmp_path.glob("outputs/*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["world_size"] == 2 and len(summary["comm_bytes_per_step"]) == 2
    (checkpoint,) = summary_file.parent.glob("checkpoints/step_000003")
    assert len(list(checkpoint.glob("rng_rank*.pt"))) == 2


def test_deepspeed_launcher_rank_argument_is_stripped():
    argv = ["train.py", "--local_rank=1", "model=gpt2-tiny", "--local_rank", "0", "x=1"]
    assert strip_launcher_args(argv) == ["train.py", "model=gpt2-tiny", "x=1"]
