"""The fp8 experiment's cost tables: activation bytes per layer against our formula
(llm.estimate.layer_terms), step time against bf16 (torchao's speed-up, judged only where
the fp8 GEMMs run for real), and each job's numbers side by side."""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from experiments.claims import COMPARISON_COLUMNS, FORMULA_COLUMNS, Claim, Table, compare, fmt
from experiments.fp8_quantisation import RECIPES, recipe
from experiments.series import median_step_time
from experiments.sweep import Job
from llm.estimate.activations import layer_terms
from llm.models.shapes import model_args
from llm.precision import resolve_precision

WARMUP_STEPS = 3  # step times after the first steps (allocation, lazy initialisation)
FASTER = (1.0, math.inf)  # bf16's step time / this recipe's: at least 1
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "our_formula",
            "our per-storage formula equals what autograd saves (docs/recompute.md)",
            "llm.estimate.layer_terms",
            "docs/recompute.md, 'The activation formula'",
            0.0,
            "summary.json activation_bytes_per_layer (saved-tensor hooks around each block, "
            "mean over blocks) against layer_terms at the run's shape and precision policy",
        ),
        Claim(
            "fp8_speedup",
            "float8 training runs faster than bf16: up to 1.25x at 8 GPUs / 8B parameters "
            "(torch.compile on)",
            "> 1x (up to 1.25x)",
            "torchao.float8 README (docs/references.md)",
            0.0,
            f"bf16's median step_time_s / this recipe's (after step {WARMUP_STEPS}, steps "
            "recording fp8 stats left out); ours: one GPU, eager",
        ),
    )
}


def precision(job: Job) -> str:
    """bf16, fp32, or the fp8 recipe's name."""
    return recipe(job) or job.get("precision.name")


def reference(jobs: list[Job], name: str = "bf16") -> Job | None:
    return next((j for j in jobs if precision(j) == name and not j.failed), None)


def shape(job: Job):
    m = job.get("model")
    keys = ("max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "dropout")
    return model_args(m["name"], **{k: m.get(k) for k in keys})


def measured_bytes(job: Job) -> float | None:
    per_layer = None if job.failed else job.summary.get("activation_bytes_per_layer")
    return statistics.mean(per_layer) if per_layer else None


def formula_bytes(job: Job) -> int:
    policy = resolve_precision(
        job.get("precision.name"),
        torch.device("cpu"),  # the dtypes; the device the run had is passed below
        fp8_recipe=job.get("precision.fp8_recipe") or "tensorwise",
    )
    if policy.fp8:  # what the run did: emulated, or torchao's kernels on its GPU
        policy = dataclasses.replace(policy, fp8_emulated=bool(job.summary.get("fp8_emulated")))
    terms = layer_terms(
        shape(job),
        int(job.get("train.micro_batch_size")),
        int(job.get("data.seq_len")),
        policy,
        backend=job.attention_backend(),
        device=job.summary["device"],
        recompute=job.get("recompute.name", "none"),
    )
    return sum(terms.values())


def memory_table(jobs: list[Job]) -> Table:
    ref = reference(jobs)
    ref_bytes = measured_bytes(ref) if ref else None
    rows = []
    for j in jobs:
        ours = measured_bytes(j)
        if ours is None:
            reason = "no measurement (the job failed)" if j.failed else "no blocks counted"
            rows.append(compare(CLAIMS["our_formula"], precision(j), None, 0, " B", reason))
            continue
        against = f" ({ours / ref_bytes:.3f}x bf16's)" if ref_bytes else ""
        row = compare(CLAIMS["our_formula"], precision(j) + against, ours, formula_bytes(j), " B")
        rows.append(row)
    return Table(
        "Activation bytes per layer against our formula",
        FORMULA_COLUMNS,
        rows,
        note="What one block keeps for backward, against llm.estimate.layer_terms at the "
        "run's shape and precision policy (our formula, not a published figure). deepseek "
        "keeps fp8 copies of its linears' inputs and weights with their scales (DeepSeek-V3 "
        "§3.3.3); tensorwise and rowwise keep the bf16 input and cast it afresh in backward, "
        "as torchao does.",
    )


def speed_table(jobs: list[Job]) -> Table:
    ref = reference(jobs)
    t_ref = median_step_time(ref, WARMUP_STEPS) if ref else None
    rows = []
    for j in jobs:
        if precision(j) not in RECIPES:
            continue
        t = None if j.failed else median_step_time(j, WARMUP_STEPS)
        speedup = t_ref / t if t and t_ref else None
        reason = None
        if ref is None:
            reason = "the bf16 job failed"
        elif not j.failed and j.summary.get("fp8_emulated"):
            where = "GPU" if j.summary.get("device") == "cuda" else "CPU"
            reason = (
                f"emulated on the {where} (fp32 matmuls of dequantised operands): it "
                "measures the recipe's rounding, not fp8's speed"
            )
        setting = f"{precision(j)} vs bf16"
        rows.append(compare(CLAIMS["fp8_speedup"], setting, speedup, FASTER, "x", reason))
    return Table("Step time against bf16", COMPARISON_COLUMNS, rows)


def per_job_table(jobs: list[Job], label) -> Table:
    rows = []
    for j in jobs:
        if j.failed:
            continue
        s = j.summary
        rows.append(
            (
                label(j),
                "yes" if s.get("fp8_emulated") else "no" if recipe(j) else "-",
                fmt(s.get("final_train_loss"), digits=5),
                fmt(s.get("final_val_loss"), digits=5),
                fmt(median_step_time(j, WARMUP_STEPS)),
                fmt(measured_bytes(j), " B"),
                fmt(s.get("max_peak_memory_bytes"), " B"),
            )
        )
    return Table(
        "Per job",
        (
            "precision",
            "fp8 emulated",
            "final train loss",
            "final val loss",
            "median step s",
            "activation bytes per layer",
            "peak memory",
        ),
        rows,
        note=f"median step_time_s of the timed steps after step {WARMUP_STEPS}: a step that "
        "runs an instrument (fp8 stats, the memory probes) is never timed; peak memory where "
        "the run tracked it (train.memory_tracking).",
    )
