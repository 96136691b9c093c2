"""The memory estimator against the allocator: ``llm.estimate``'s total (model states +
activations) for a configuration, beside ``torch.cuda.max_memory_allocated`` over the
training steps of the same configuration run by train.py's code (llm.launch.launcher), for
gpt2-small, gpt2-medium and llama-1b under recompute none, selective, full and op_sac.
Beside them, the peak tracker's step peak (live tensors only: no cuBLAS workspace), its
phase and its activations and other bytes, so a row that misses can be taken apart against
the estimate's moment and rows (less its ``cublas_workspaces``).

Each run trains 3 steps, bf16, at T=1024 on a small corpus of standard-library files with a
4096-token BPE; the measured figure is the run's step peak (``peak_memory_bytes``, the
allocator's highest per-step peak). The dry run does the same on CPU with gpt2-tiny, where
the peak is the tracker's live tensor bytes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import shutil
import sysconfig
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from benchmarks.gpu_pass.common import Goal, Result, device, write_partial_rows
from llm.build import model_args_for, tokenizer_vocab_size
from llm.config import register_configs, to_dataclass
from llm.estimate.estimator import estimate
from llm.estimate.workspaces import training_workspaces
from llm.launch.launcher import launch
from llm.validate import validate

CONF = Path(__file__).resolve().parents[2] / "conf"
POLICIES = ["none", "selective", "full", "op_sac"]
GOAL = 0.03
# (model, micro-batch) at seq_len; the dry run's tiny model on CPU. llama-1b first: the
# 2026-11-28 record's limit cut the sweep before it (about 9 s a row with the tracker), and
# its rows are the ones no record since the first has measured.
GPU = {"models": [("llama-1b", 4), ("gpt2-medium", 8), ("gpt2-small", 8)], "seq_len": 1024}
DRY = {"models": [("gpt2-tiny", 4)], "seq_len": 64}
BLOCKS = 6  # train.allocator_blocks of each GPU row


def compose_config(overrides: list[str]):
    """The config train.py would compose from ``overrides``."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_dataclass(compose(config_name="config", overrides=overrides))


def small_corpus(root: Path, modules: int | None = 40) -> Path:
    """``modules`` standard-library modules (None: every top-level one, about 4.7 MB) as text
    documents: every machine has them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder = root / "corpus"
    folder.mkdir()
    for path in sorted(stdlib.glob("*.py"))[:modules]:
        shutil.copy(path, folder / f"{path.stem}.txt")
    return folder


def corpus_overrides(work: Path) -> list[str]:
    """small_corpus's files under ``work``, through a 4096-token BPE trained on them."""
    return [
        "data=files",
        f"data.path={work / 'corpus'}",
        f"data.cache_dir={work / 'cache'}",
        "data.tokenizer=bpe",
        "data.vocab_size=4096",
        "data.val_samples=2",
    ]


def overrides(work: Path, model: str, batch: int, policy: str, seq_len: int, dry: bool):
    return [
        f"output_dir={work / f'{model}-{policy}'}",
        f"model={model}",
        f"recompute={policy}",
        "precision=bf16",
        *corpus_overrides(work),
        f"data.seq_len={seq_len}",
        f"train.device={device(dry).type}",
        "train.max_steps=3",
        f"train.micro_batch_size={batch}",
        "train.log_every=1",
        "train.eval_every=1000",
        "scheduler.warmup_steps=1",
        "checkpoint.enabled=false",
        "logger=none",
        "logger.progress=false",
        f"estimate.device={device(dry).type}",
        # On the GPU, the allocator's largest blocks at the step's peak (a note per row):
        # what the allocator holds that no tensor does.
        *([] if dry else [f"train.allocator_blocks={BLOCKS}"]),
    ]


def measure(work: Path, model: str, batch: int, policy: str, seq_len: int, dry: bool) -> dict:
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if not dry else 0
    cfg = compose_config(overrides(work, model, batch, policy, seq_len, dry))
    validate(cfg)
    summary = launch(cfg)
    est = estimate(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))
    measured = summary["peak_memory_bytes"]
    tracked = summary["memory_peak"][0]  # rank 0's tracked step peak: live tensors only
    return {
        "model": model,
        "recompute": policy,
        "batch": batch,
        "estimate_mib": est.total / 2**20,
        "measured_mib": measured / 2**20,
        "error_pct": 100 * (est.total / measured - 1),
        "activations_mib": est.device.get("activations", 0) / 2**20,
        "left_from_before_mib": before / 2**20,
        "estimate_moment": est.peak_moment,
        "tracked_mib": tracked["total"] / 2**20,
        "tracked_phase": tracked["phase"],
        "tracked_activations_mib": tracked["activations"] / 2**20,
        "tracked_other_mib": tracked["other"] / 2**20,
        "workspaces_mib": est.peak_rows.get("cublas_workspaces", 0) / 2**20,
        "allocator_blocks": (summary.get("memory_allocator_blocks") or [None])[0],
    }


def blocks_note(row: dict) -> str | None:
    """One line of the row's allocator blocks at its peak, largest first; None without."""
    blocks = row.get("allocator_blocks")
    if not blocks:
        return None
    said = "; ".join(f"{b['bytes'] / 2**20:.1f} MiB {b['made_by']}" for b in blocks.values())
    return f"{row['model']} {row['recompute']}: the allocator's largest blocks at the peak: {said}"


def held_by_one_matmul() -> int:
    """Bytes one matmul's forward (this thread) and backward (autograd's device thread)
    leave allocated beyond their tensors, on a stream of their own: torch keys a workspace
    by (handle, stream), so both are new there, and nothing private clears the others."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(256, 256, device="cuda", requires_grad=True)
        w = torch.randn(256, 256, device="cuda", requires_grad=True)
        stream.synchronize()
        before = torch.cuda.memory_allocated()
        (x @ w).sum().backward()
        stream.synchronize()
        grads = x.grad.untyped_storage().nbytes() + w.grad.untyped_storage().nbytes()
        return torch.cuda.memory_allocated() - before - grads


def workspace_note() -> str:
    """The measured workspaces beside the estimate's cublas_workspaces row. Measured in a
    process of its own: the side stream's workspaces stay allocated for the life of the
    process, and the 2026-11-28 record's rows, measured after it in one process, each
    counted its 64 MiB in their allocator peak."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        held = pool.submit(held_by_one_matmul).result()
    return (
        f"cuBLAS workspaces: one matmul's forward and backward left "
        f"{held / 2**20:.3f} MiB allocated beyond their tensors; the "
        f"estimate's row is {training_workspaces('cuda') / 2**20:.3f} MiB"
    )


def run(dry: bool) -> Result:
    s = DRY if dry else GPU
    rows, failed = [], []
    measured = [] if dry else [workspace_note()]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        small_corpus(work)
        for model, batch in s["models"]:
            for policy in POLICIES:
                try:
                    rows.append(measure(work, model, batch, policy, s["seq_len"], dry))
                except Exception as e:  # a row that fails is reported; the sweep goes on
                    failed.append(
                        f"{model} {policy}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    )
                print(rows[-1] if rows else None, flush=True)
                write_partial_rows(_result(rows, failed, measured, dry))
    return _result(rows, failed, measured, dry)


def _notes(rows: list[dict], measured: list[str], failed: list[str]) -> list[str]:
    return measured + [n for r in rows if (n := blocks_note(r))] + failed


def _goal(rows: list[dict], failed: list[str], dry: bool) -> Goal:
    """Every row within GOAL, and no row failed; not measured with no row."""
    name, target = "estimate against measured, every row", f"within {GOAL:.0%}"
    if not rows:
        return Goal.unmeasured(name, target)
    worst = max(abs(r["error_pct"]) for r in rows)
    met = None if dry else worst <= 100 * GOAL and not failed
    return Goal(name, target, f"largest error {worst:.2f}%", met)


def _result(rows: list[dict], failed: list[str], measured: list[str], dry: bool) -> Result:
    s = DRY if dry else GPU
    what = "allocator's step peak" if not dry else "peak tracker's live bytes (CPU)"
    return Result(
        title="memory estimator against the measured step peak",
        shapes=f"T={s['seq_len']}, bf16, AdamW, vocabulary 4096 (BPE), 3 steps; measured: {what}",
        columns=["model", "recompute", "batch", "estimate_mib", "measured_mib", "error_pct",
                 "activations_mib", "left_from_before_mib", "estimate_moment", "tracked_mib",
                 "tracked_phase", "tracked_activations_mib", "tracked_other_mib",
                 "workspaces_mib"],
        rows=rows,
        goals=[_goal(rows, failed, dry)],
        notes=_notes(rows, measured, failed),
    )  # fmt: skip
