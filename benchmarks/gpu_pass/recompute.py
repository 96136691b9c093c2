"""Recompute policies: step-time overhead of each against none, activation bytes per layer
against the formula, and the step's allocator peak (benchmarks/recompute.py's sweep:
gpt2-medium, bf16, sdpa, T=2048, B=4, on the GPU; offload included there)."""

from __future__ import annotations

from dataclasses import asdict

import recompute as bench

from benchmarks.gpu_pass.common import Goal, Result
from llm.models import MODEL_SHAPES, model_args

SELECTIVE_GOAL = 5.0  # percent
GPU = ["--device", "cuda", "--model", "gpt2-medium", "--seq-lens", "2048", "--batch", "4",
       "--precision", "bf16", "--steps", "5", "--warmup", "2"]  # fmt: skip
DRY = ["--device", "cpu", "--model", "gpt2-tiny", "--seq-lens", "64", "--batch", "2", "--backends", "sdpa",
       "--steps", "2", "--warmup", "1"]  # fmt: skip


def _goal(rows: list[dict], dry: bool) -> Goal:
    """The largest overhead of selective's rows; not measured with none."""
    name, target = "step-time overhead of selective recompute", f"<= {SELECTIVE_GOAL:g}%"
    selective = [r["overhead_pct"] for r in rows if r["policy"] == "selective"]
    selective = [v for v in selective if v is not None]
    if not selective:
        return Goal.unmeasured(name, target)
    worst = max(selective)
    return Goal(name, target, f"{worst:+.1f}%", None if dry else worst <= SELECTIVE_GOAL)


def run(dry: bool) -> Result:
    a = bench.parse(DRY if dry else GPU)
    longest = max(max(a.seq_lens), MODEL_SHAPES[a.model].max_seq_len)
    rows = [asdict(r) for r in bench.sweep(model_args(a.model, max_seq_len=longest), a)]
    for r in rows:
        for key in ("layer_bytes", "formula_bytes", "activation_bytes", "peak_bytes"):
            value = r.pop(key)
            r[key.replace("bytes", "mib")] = None if value is None else value / 2**20
    return Result(
        title=f"recompute policies, {a.model}",
        shapes=(
            f"{a.model}, {a.precision}, T={a.seq_lens}, B={a.batch}, backends {a.backends}, "
            f"median of {a.steps} steps after {a.warmup}"
        ),
        columns=["backend", "seq_len", "policy", "layer_mib", "formula_mib", "ratio",
                 "activation_mib", "peak_mib", "step_ms", "overhead_pct"],
        rows=rows,
        goals=[_goal(rows, dry)],
    )  # fmt: skip
