"""torchtitan's own Llama 3 trainer as the peer row of the ``speed`` section.

``titan_row`` runs ``python -m torchtitan.train`` (its Trainer, its JobConfig from its
command line) in a subprocess on one GPU (world size 1), at our shape, batch, recompute
(none) and compile, and reads back tokens/s, the allocator's peak and the loss.

Which torchtitan: the newest release that runs on the GPU image's torch 2.11 is 0.2.2
(``TITAN_VERSION``, pinned in requirements-gpu.txt). 0.3.0, the release the issue names,
imports ``torch.distributed.fsdp.DataParallelMeshDims`` at import time
(torchtitan/distributed/full_dtensor.py, reached from its trainer), which torch adds after
2.11; ``titan_row`` checks for that symbol and the row's note says which version ran and why.

Precision: torchtitan keeps parameters in ``training.dtype`` (float32 here) and, on one
device without FSDP, runs forward and loss under ``torch.autocast(device, bf16)``
(``training.mixed_precision_param``, applied by its ``maybe_enable_amp``): fp32 master
weights, fp32 AdamW state, bf16 matmuls, as ours and transformers run in speed_rows.py.
AdamW is torchtitan's (fused, betas 0.9/0.95, eps 1e-8, weight decay 0.1, the same as
speed_rows.ADAMW) except the learning rate, which is ours, held constant (warm-up 0, decay
0: its scheduler otherwise warms up over 200 steps); gradients are clipped at its
``training.max_norm`` of 1.0. Attention: its llama3 default, SDPA, causal.

The data: the row's token file, batch ``i`` at step ``i``, as ours and transformers read it,
through torchtitan's TrainSpec extension points (titan_spec.py), torchtitan unpatched.

Figures: torchtitan logs every step (``metrics.log_freq`` 1); its metrics dicts come back as
JSON lines (titan_spec.JsonLinesLogger). tokens/s: the median of its ``throughput(tps)``
over the timed steps after warm-up (each step's tokens over the time since its previous
log, the loss read included). Loss: its ``global_avg_loss`` of the last step. Peak:
``torch.cuda.max_memory_allocated`` read by that logger after each step, the maximum over
the run. Top kernels: none; torchtitan's profiler schedules its traced steps inside one
profile context around the whole loop, so it cannot trace one step apart from the timed ones.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TITAN_VERSION = "0.2.2"
ISSUE_VERSION = "0.3.0"
NEEDED_SYMBOL = ("torch.distributed.fsdp", "DataParallelMeshDims")  # what 0.3.0 imports
SPEC_ENV = "GPU_PASS_TITAN_SPEC"
SPEC_NAME = "llm_speed_llama"
FLAVOR = "row"
LOSS_KEY, TPS_KEY, PEAK_KEY = "loss_metrics/global_avg_loss", "throughput(tps)", "max_memory_allocated"  # fmt: skip
ERROR_LINES = 3


def model_fields(
    *, dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, rope_theta, norm_eps
) -> dict:
    """torchtitan's TransformerModelArgs for our shape. Its FeedForward sizes the hidden
    layer from ``dim`` (``int(8 * dim / 3)``, times ``ffn_dim_multiplier``, rounded up to
    ``multiple_of``); with ``multiple_of = ffn_dim`` and the multiplier bringing that to at
    most ``ffn_dim``, it comes out at ``ffn_dim`` exactly."""
    base = int(2 * 4 * dim / 3)
    return {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "vocab_size": vocab_size,
        "multiple_of": ffn_dim,
        "ffn_dim_multiplier": None if base <= ffn_dim else ffn_dim / base,
        "rope_theta": rope_theta,
        "norm_eps": norm_eps,
    }


def job_args(*, batch, seq_len, steps, warmup, compile, lr, dump_folder) -> list[str]:
    """torchtitan's command line (its JobConfig) for the row."""
    args = [
        "--experimental.custom_import", "benchmarks.gpu_pass.titan_spec",
        "--model.name", SPEC_NAME,
        "--model.flavor", FLAVOR,
        "--job.dump_folder", dump_folder,
        "--training.local_batch_size", str(batch),
        "--training.seq_len", str(seq_len),
        "--training.steps", str(warmup + steps),
        "--training.dtype", "float32",
        "--training.mixed_precision_param", "bfloat16",
        "--parallelism.data_parallel_shard_degree", "1",
        "--activation_checkpoint.mode", "none",
        "--optimizer.lr", str(lr),
        "--lr_scheduler.warmup_steps", "0",
        "--lr_scheduler.decay_ratio", "0",
        "--metrics.log_freq", "1",
        "--debug.seed", "0",
    ]  # fmt: skip
    return args + (["--compile.enable"] if compile else [])


def parse_metrics(lines: list[str], *, warmup: int, steps: int) -> dict:
    """tokens/s (median of the timed steps), the last step's loss and the run's allocator
    peak from the JSON lines of torchtitan's metrics; ValueError when a step is missing."""
    records = {r["step"]: r for r in (json.loads(line) for line in lines if line.strip())}
    timed = range(warmup + 1, warmup + steps + 1)  # torchtitan counts steps from 1
    missing = [s for s in timed if s not in records]
    if missing:
        raise ValueError(f"torchtitan logged no metrics for steps {missing}")
    peaks = [r[PEAK_KEY] for r in records.values() if PEAK_KEY in r]
    return {
        "tokens_per_s": statistics.median(records[s][TPS_KEY] for s in timed),
        "loss": records[timed[-1]][LOSS_KEY],
        "peak_alloc_bytes": max(peaks) if peaks else None,
    }


def _row(note: str, **figures) -> dict:
    row = {"tokens_per_s": None, "peak_alloc_bytes": None, "loss": None, "top_kernels": None}
    return {**row, **figures, "note": note}


def _why_not_0_3() -> str:
    module, name = NEEDED_SYMBOL
    if hasattr(importlib.import_module(module), name):
        return f"{module}.{name} is in this torch"
    return (
        f"torchtitan {ISSUE_VERSION} imports {module}.{name}, absent from torch {torch.__version__}"
    )


def unavailable() -> str | None:
    """Why torchtitan's trainer cannot run here, from the import and the device; None if it can."""
    try:
        version = importlib.metadata.version("torchtitan")
        importlib.import_module("torchtitan.train")
        from torchtitan.tools import utils
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan is not installed (make gpu-wheels carries torchtitan=={TITAN_VERSION})"
    except ImportError as e:
        return f"torchtitan {version} does not import: {type(e).__name__}: {e}"
    if utils.device_type == "cuda" and not torch.cuda.is_available():
        return (
            f"torchtitan {version}'s trainer takes device_type 'cuda' (it has no CPU "
            "path) and torch.cuda.is_available() is False"
        )
    return None


def _error_tail(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errors or lines)[-ERROR_LINES:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(spec: dict, args: list[str], limit_s: float, tmp: Path) -> subprocess.CompletedProcess:
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        SPEC_ENV: str(spec_path),
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "torchtitan.train", *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit_s, check=False
    )


def titan_row(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    rope_theta: float,
    norm_eps: float,
    batch: int,
    seq_len: int,
    steps: int,
    warmup: int,
    compile: bool,
    tokens_path: str,
    dry: bool,
    limit_s: float,
) -> dict:
    """One row: torchtitan's tokens/s, allocator peak and loss after ``warmup + steps``
    steps on the token file; a row with ``note`` "not run: ..." where it cannot run.
    ``dry`` runs it for real where torchtitan can (it needs CUDA)."""
    why = unavailable()
    if why is not None:
        return _row(f"not run: {why}")
    from benchmarks.gpu_pass.speed_rows import ADAMW  # here: torchtitan's process skips llm

    shape = model_fields(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
        vocab_size=vocab_size, rope_theta=rope_theta, norm_eps=norm_eps,
    )  # fmt: skip
    version = importlib.metadata.version("torchtitan")
    with tempfile.TemporaryDirectory(prefix="titan_row_") as tmp_name:
        tmp = Path(tmp_name)
        metrics_path = tmp / "metrics.jsonl"
        spec = {"model": shape, "tokens_path": tokens_path, "metrics_path": str(metrics_path)}
        args = job_args(batch=batch, seq_len=seq_len, steps=steps, warmup=warmup,
                        compile=compile, lr=ADAMW["lr"], dump_folder=str(tmp / "out"))  # fmt: skip
        try:
            done = _run(spec, args, limit_s, tmp)
        except subprocess.TimeoutExpired:
            return _row(f"not run: torchtitan {version} ran past the row's {limit_s:.0f} s")
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    if done.returncode != 0:
        return _row(f"not run: torchtitan {version} exited {done.returncode}: "
                    f"{_error_tail(done.stderr)}")  # fmt: skip
    try:
        figures = parse_metrics(lines, warmup=warmup, steps=steps)
    except ValueError as e:
        return _row(f"not run: {e}")
    note = (
        f"torchtitan {version}'s llama3 Trainer ({_why_not_0_3()}); same tokens in the same "
        "order (its TrainSpec dataloader); peak: torch.cuda.max_memory_allocated read after "
        "each of its steps; top kernels: its profiler cannot trace one step apart"
    )
    return _row(note, **figures)
