"""One rank of a cluster-sized run, rehearsed alone on this GPU, beside the estimator: the
two sizes issue 42 names and no real run here reaches, llama3-8b under fsdp over 64 ranks
and in 3D over 512 (tp 8 x pp 8 x ZeRO-1 over dp 8), at T=8192, bf16.

Each case first asks the estimator (estimate.device=cuda, nodes of 8) which rank sets the
peak (``Estimate.rank``: the pipeline stage with the largest total), then runs
``python -m llm.rehearse`` for that rank in a process of its own (one rehearsal per process:
DTensor's caches key on device meshes) and reads its rehearse.json. Columns: the model
states, rehearsed and estimated (equal, to the byte, is the claim); the tracker's step peak
(live tensors) against the estimate less its cuBLAS workspaces; the allocator's peak against
the whole estimate. The dry run rehearses tiny models at 4 and 8 ranks on CPU, where there
is no allocator and no workspace, at llama3-8b's proportions (``SMALL_LLAMA``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_pass.common import Goal, Result, deadline, device, write_partial_rows
from benchmarks.gpu_pass.estimator import compose_config, corpus_overrides, small_corpus
from llm.build import model_args_for, tokenizer_vocab_size
from llm.estimate.estimator import estimate

GOAL = 0.03
STATES = ("params", "grads", "optimizer_states")
GPUS_PER_NODE = 8
RESERVE_S = 40  # a case's rehearsal is not started with less of the section's limit left


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    overrides: tuple[str, ...]


THREE_D = ("parallelism=zero1", "parallelism.tp_size=8", "parallelism.pp_size=8",
           "parallelism.dp_size=8")  # fmt: skip
GPU = [
    Case("llama3-8b fsdp x64", 64,
         ("model=llama3-8b", "parallelism=fsdp", "data.seq_len=8192",
          "train.micro_batch_size=1")),
    Case("llama3-8b 3D x512", 512,
         ("model=llama3-8b", *THREE_D, "data.seq_len=8192", "train.micro_batch_size=8")),
]  # fmt: skip
# llama3-8b's proportions in small: a vocabulary 32 times the width, T twice it, d_ff 3.5x.
SMALL_LLAMA = ("model=llama-tiny", "model.d_model=128", "model.d_ff=448", "data.seq_len=256")
DRY = [
    Case("llama-tiny fsdp x4", 4,
         (*SMALL_LLAMA, "model.n_layers=4", "parallelism=fsdp", "train.micro_batch_size=1")),
    Case("llama-tiny 3D x8", 8,
         (*SMALL_LLAMA, "model.n_layers=8", "parallelism=zero1", "parallelism.tp_size=2",
          "parallelism.pp_size=2", "parallelism.dp_size=2", "train.micro_batch_size=2")),
]  # fmt: skip


def overrides(work: Path, case: Case, dry: bool) -> list[str]:
    """The run's overrides, shared by the estimate and the rehearsal."""
    return [
        *case.overrides,
        "precision=bf16",
        *corpus_overrides(work),
        f"train.device={device(dry).type}",
        "train.eval_every=1000",
        "scheduler.warmup_steps=1",
        "logger=none",
    ]


def estimate_for(work: Path, case: Case, dry: bool):
    """The estimator's figures for the case on its whole cluster; its ``rank`` is the one
    that sets the peak."""
    nodes = 1 if dry else case.world // GPUS_PER_NODE
    per_node = case.world if dry else GPUS_PER_NODE
    cfg = compose_config(
        [
            *overrides(work, case, dry),
            f"output_dir={work / 'estimate'}",
            f"estimate.device={device(dry).type}",
            f"estimate.nodes={nodes}",
            f"estimate.gpus_per_node={per_node}",
        ]
    )
    return estimate(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))


def failure(output: str) -> str:
    """What a failed rehearsal said: our one-line ``error:``, else the traceback's last line
    (HYDRA_FULL_ERROR=1 keeps Hydra from putting its hint there instead), at most 600
    characters."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error: ")]
    return (said or lines or ["no output"])[-1][:600]


def rehearse_rank(work: Path, case: Case, rank: int, dry: bool, timeout_s: float) -> dict:
    """``python -m llm.rehearse`` for ``rank`` of the case, in a process of its own."""
    out = work / case.name.replace(" ", "_")
    done = subprocess.run(
        [
            sys.executable, "-m", "llm.rehearse", *overrides(work, case, dry),
            f"rehearse.world_size={case.world}", f"rehearse.rank={rank}",
            f"rehearse.json={out / 'rehearse.json'}", f"hydra.run.dir={out}",
        ],
        capture_output=True, text=True, timeout=timeout_s, check=False,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )  # fmt: skip
    if done.returncode != 0:
        said = failure(done.stdout + "\n" + done.stderr)
        raise RuntimeError(f"llm.rehearse exited {done.returncode}: {said}")
    return json.loads((out / "rehearse.json").read_text())


def row(case: Case, est, figures: dict) -> dict:
    mib = 2**20
    peak = figures["memory_peak"]
    workspaces = est.peak_rows.get("cublas_workspaces", 0)
    allocator = figures["cuda_max_allocated_bytes"]
    rehearsed_states = {k: figures["model_state_bytes"][k] for k in STATES}
    return {
        "case": case.name,
        "rank": est.rank,
        "states_equal": rehearsed_states == {k: est.device[k] for k in STATES},
        "states_mib": sum(rehearsed_states.values()) / mib,
        "tracked_mib": peak["total"] / mib,
        "tracked_phase": peak["phase"],
        "estimate_less_workspaces_mib": (est.total - workspaces) / mib,
        "tracked_error_pct": 100 * ((est.total - workspaces) / peak["total"] - 1),
        "allocator_mib": None if allocator is None else allocator / mib,
        "estimate_mib": est.total / mib,
        "allocator_error_pct": None if allocator is None else 100 * (est.total / allocator - 1),
        "estimate_moment": est.peak_moment,
        "step_time_s": figures["step_time_s"],
    }


def run(dry: bool) -> Result:
    cases = DRY if dry else GPU
    rows, failed = [], []
    stop_at = deadline(RESERVE_S)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Every stdlib module: a step of the GPU cases takes 64 sequences of 8192 tokens
        small_corpus(work, modules=None)
        for case in cases:
            left = stop_at - time.monotonic()
            if left <= 0:
                failed.append(f"{case.name}: not run (the section's time ran out)")
                continue
            try:
                est = estimate_for(work, case, dry)
                figures = rehearse_rank(work, case, est.rank, dry, left + RESERVE_S / 2)
                rows.append(row(case, est, figures))
            except Exception as e:  # a case that fails is reported; the next one runs
                failed.append(f"{case.name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(rows[-1] if rows else None, flush=True)
            write_partial_rows(_result(rows, failed, dry))
    return _result(rows, failed, dry)


def _goals(rows: list[dict], failed: list[str], dry: bool) -> list[Goal]:
    """States equal in every case; the estimate within GOAL of the tracker's and the
    allocator's peaks in every case (not judged on CPU, nor with no case tried); a case
    that failed misses both."""
    states = Goal.unmeasured("model states, rehearsed = estimated", "equal in every case")
    total = Goal.unmeasured("estimate against the rehearsed peak", f"within {GOAL:.0%}")
    if not rows:
        if not failed:
            return [states, total]
        ran = f"no case ran: {len(failed)} failed"  # a failed case meets no goal
        return [Goal(states.name, states.target, ran, False),
                Goal(total.name, total.target, ran, None if dry else False)]  # fmt: skip
    equal = all(r["states_equal"] for r in rows)
    states = Goal(states.name, states.target, f"{sum(r['states_equal'] for r in rows)} of "
                  f"{len(rows)} equal", equal and not failed)  # fmt: skip
    errors = [abs(r["tracked_error_pct"]) for r in rows]
    errors += [abs(r["allocator_error_pct"]) for r in rows if r["allocator_error_pct"] is not None]
    met = None if dry else max(errors) <= 100 * GOAL and not failed
    total = Goal(total.name, total.target, f"largest error {max(errors):.2f}%", met)
    return [states, total]


def _result(rows: list[dict], failed: list[str], dry: bool) -> Result:
    what = "llama3-8b, T=8192" if not dry else "llama-tiny at width 128, T=256, CPU"
    return Result(
        title="one rank of a cluster run, rehearsed, against the estimator",
        shapes=f"{what}, bf16, AdamW, vocabulary of the model (data: 4096-token BPE)",
        columns=["case", "rank", "states_equal", "states_mib", "tracked_mib", "tracked_phase",
                 "estimate_less_workspaces_mib", "tracked_error_pct", "allocator_mib",
                 "estimate_mib", "allocator_error_pct", "estimate_moment", "step_time_s"],
        rows=rows,
        goals=_goals(rows, failed, dry),
        notes=failed,
    )  # fmt: skip
