"""Precisions on one token budget: fp32, tf32, fp16 with our dynamic loss scaler, bf16
(autocast, fp32 master weights), bf16_pure (no fp32 copy) and fp8 (GPU scale). Loss curves,
the final validation loss against fp32 (Micikevicius et al., 2018: no accuracy loss), the
parameter bytes against fp32 and the step time (the design articles: half the weight memory,
1.5-3x faster), and fp16's loss-scale trace with its skipped steps."""

from __future__ import annotations

import matplotlib.pyplot as plt

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, fmt
from experiments.series import median_step_time
from experiments.sweep import Job

MP_SOURCE = "Micikevicius et al., 2018, arXiv:1710.03740 (docs/references.md)"
ARTICLES = "design articles' claim (docs/references.md), to be tested"
WARMUP_STEPS = 3  # step times after the first steps (allocation, lazy initialisation)
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "no_accuracy_loss",
            "mixed precision with fp32 master weights and loss scaling matches fp32 accuracy",
            "no accuracy loss",
            MP_SOURCE,
            0.02,
            "final validation loss / fp32's (same data, seed and token budget)",
        ),
        Claim(
            "half_weight_memory",
            "fp16/bf16 halve weight memory",
            "0.5x fp32",
            ARTICLES,
            0.05,
            "rank 0's parameter bytes (model_state_bytes[0].params) / fp32's",
        ),
        Claim(
            "speedup",
            "fp16/bf16 train 1.5-3x faster than fp32",
            "1.5-3x",
            ARTICLES,
            0.0,
            f"fp32's median step_time_s / this precision's (after step {WARMUP_STEPS})",
        ),
    )
}


def precision(job: Job) -> str:
    return job.override("precision") or job.get("precision.name")


def _fp32(jobs: list[Job]) -> Job | None:
    return next((j for j in jobs if precision(j) == "fp32" and not j.failed), None)


def _on_gpu(job: Job) -> bool:
    return not job.failed and job.summary.get("device") == "cuda"


def report(jobs: list[Job]) -> list[Table]:
    ref = _fp32(jobs)
    missing = None if ref is not None else "the fp32 job failed"
    acc, mem, speed, scale = [], [], [], []
    for j in jobs:
        p = precision(j)
        if p == "fp32":
            continue
        ok = not j.failed and ref is not None
        val = ok and j.summary.get("final_val_loss")
        acc.append(
            compare(
                CLAIMS["no_accuracy_loss"],
                f"{p} vs fp32",
                val / ref.summary["final_val_loss"] if val else None,
                1.0,
                not_comparable=missing,
            )
        )
        params = ok and j.summary["model_state_bytes"][0]["params"]
        ref_params = ref.summary["model_state_bytes"][0]["params"] if ref else None
        mem.append(
            compare(
                CLAIMS["half_weight_memory"],
                f"{p} vs fp32",
                params / ref_params if params else None,
                0.5,
                not_comparable=missing,
            )
        )
        t = median_step_time(j, WARMUP_STEPS) if ok else None
        t_ref = median_step_time(ref, WARMUP_STEPS) if ref else None
        reason = missing or (
            None if _on_gpu(j) else "CPU: no 16-bit tensor cores, so no 16-bit speed-up to find"
        )
        speedup = t_ref / t if t and t_ref else None
        speed.append(compare(CLAIMS["speedup"], f"{p} vs fp32", speedup, (1.5, 3.0), "x", reason))
    for j in jobs:
        if j.failed:
            continue
        scales = [v for _, v in j.metric("loss_scale")]
        scale.append(
            (
                precision(j),
                f"{j.summary['final_val_loss']:.4f}",
                j.summary.get("skipped_steps", 0),
                fmt(scales[0]) if scales else "-",
                fmt(scales[-1]) if scales else "-",
                fmt(median_step_time(j, WARMUP_STEPS)),
            )
        )
    return [
        Table("Final validation loss against fp32", COMPARISON_COLUMNS, acc),
        Table(
            "Parameter memory against fp32",
            COMPARISON_COLUMNS,
            mem,
            note="fp16 and bf16 keep fp32 parameters and cast the compute (autocast, the "
            "paper's fp32 master copy); only bf16_pure holds 16-bit parameters.",
        ),
        Table("Step time against fp32", COMPARISON_COLUMNS, speed),
        Table(
            "Per precision",
            (
                "precision",
                "final val loss",
                "skipped steps",
                "first loss scale",
                "last loss scale",
                "median step s",
            ),
            scale,
            note="The loss scale is 1 (disabled) outside fp16; a skipped step had a non-finite "
            "gradient and left weights and optimizer state unchanged.",
        ),
    ]


def plots(jobs: list[Job]) -> dict:
    fig, (curves, scales) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for j in jobs:
        if j.failed:
            continue
        steps, losses = zip(*j.metric("loss"), strict=True)
        curves.plot(steps, losses, label=precision(j))
        trace = j.metric("loss_scale")
        if precision(j) == "fp16" and trace:
            scales.semilogy(*zip(*trace, strict=True), label="fp16 loss scale")
            skipped = [s for s, v in j.metric("skipped") if v]
            scale_at = dict(trace)
            if skipped:
                scales.plot(skipped, [scale_at[s] for s in skipped], "rx", label="skipped step")
    curves.set_ylabel("training loss")
    curves.set_title("One token budget per precision")
    if curves.lines:
        curves.legend()
    scales.set_ylabel("loss scale")
    scales.set_xlabel("step")
    if scales.lines:
        scales.legend()
    return {"mixed_precision": fig}
