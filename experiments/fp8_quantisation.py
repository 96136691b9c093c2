"""The fp8 experiment's quantisation tables: each GEMM operand's relative error per block and
tensor kind, finer scales against one per tensor, and saturation, from summary.json's
``fp8_stats`` ({linear: {operand: {kind, calls, mean_rel_error, max_rel_error, saturated,
saturated_fraction}}}, summed over the steps that recorded them)."""

from __future__ import annotations

import math
import re

import matplotlib.pyplot as plt

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, fmt
from experiments.sweep import Job

RECIPES = ("tensorwise", "rowwise", "deepseek")
KINDS = ("activation", "weight", "gradient")
# output = input @ weight^T; grad_input = grad_output @ weight_t;
# grad_weight = grad_output_t^T @ input_t (llm/precision/fp8/stats.py)
OPERANDS = ("input", "input_t", "weight", "weight_t", "grad_output", "grad_output_t")
# One colour a precision in every plot (matplotlib's default cycle).
COLOURS = {name: f"C{i}" for i, name in enumerate(("bf16", *RECIPES, "fp32"))}
FINER = (1.0, math.inf)  # tensorwise's error / this recipe's: at least 1
BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "finer_scales",
            "scales per 1x128 tile and 128x128 block (or per row) quantise with less error "
            "than one per tensor: an outlier coarsens only its own group",
            ">= 1x",
            "DeepSeek-V3, arXiv:2412.19437, §3.3.2 (docs/references.md)",
            0.0,
            "a kind's mean relative L2 error (summary fp8_stats: each cast's ||dequantised - "
            "original|| / ||original||, averaged over every linear, operand of the kind and "
            "recorded call): tensorwise's / this recipe's",
        ),
        Claim(
            "no_saturation",
            "scales from the tensor's own current amax never push a value past the fp8 maximum",
            "0 saturated",
            "docs/fp8.md; DeepSeek-V3 §3.3.2 (online quantisation)",
            0.0,
            "elements the cast clamped to the format's maximum, summed over every linear, "
            "operand of the kind and recorded call (summary fp8_stats)",
        ),
    )
}


def recipe(job: Job) -> str | None:
    """The fp8 recipe the job ran, None for a precision without fp8."""
    return job.get("precision.fp8_recipe") if job.get("precision.name") == "fp8" else None


def stats(job: Job) -> dict | None:
    return None if job.failed else job.summary.get("fp8_stats")


def _why_no_stats(job: Job) -> str:
    if job.failed:
        return "no measurement (the job failed)"
    return job.summary.get("fp8_stats_note") or "not recorded (precision.fp8_stats_every=0)"


def casts_of_kind(st: dict, kind: str) -> list[dict]:
    """Every (layer, operand) row of ``kind`` (activation, weight, gradient)."""
    return [r for _, _, r in casts(st) if r["kind"] == kind]


def casts(st: dict) -> list[tuple[str, str, dict]]:
    """(block, operand, row) for every operand of every linear."""
    return [(block_of(layer), op, row) for layer, ops in st.items() for op, row in ops.items()]


def mean_error(rows: list[dict]) -> float | None:
    """The calls-weighted mean of the rows' mean_rel_error: the mean over every cast."""
    calls = sum(r["calls"] for r in rows)
    return sum(r["mean_rel_error"] * r["calls"] for r in rows) / calls if calls else None


def kind_error(st: dict, kind: str) -> float | None:
    return mean_error([r for _, _, r in casts(st) if r["kind"] == kind])


def block_of(layer: str) -> str:
    m = BLOCK.search(layer)
    return m.group(1) if m else "other"


def _fp8_jobs(jobs: list[Job]) -> list[Job]:
    return sorted((j for j in jobs if recipe(j)), key=lambda j: RECIPES.index(recipe(j)))


def kind_table(jobs: list[Job]) -> Table:
    rows = []
    for j in _fp8_jobs(jobs):
        st = stats(j)
        if not st:
            rows.append((recipe(j), *["-"] * 2 * len(KINDS), _why_no_stats(j)))
            continue
        cells = []
        for kind in KINDS:
            of_kind = casts_of_kind(st, kind)
            cells += [fmt(mean_error(of_kind)), fmt(max(r["max_rel_error"] for r in of_kind))]
        rows.append((recipe(j), *cells, ""))
    columns = [f"{k}s: {s}" for k in KINDS for s in ("mean", "max")]
    return Table(
        "Quantisation error by tensor kind",
        ("recipe", *columns, "note"),
        rows,
        note="Relative L2 error of each dequantised GEMM operand against the tensor it was "
        "cast from: activations (input, input_t), weights (weight, weight_t), gradients "
        "(grad_output, grad_output_t). mean: over every cast; max: the worst single cast. "
        "tensorwise casts gradients to e5m2 (2 mantissa bits), the others to e4m3 (3).",
    )


def finer_table(jobs: list[Job]) -> Table:
    base = next((j for j in jobs if recipe(j) == "tensorwise"), None)
    base_stats = stats(base) if base else None
    rows = []
    for j in _fp8_jobs(jobs):
        if recipe(j) == "tensorwise":
            continue
        st = stats(j)
        reason = None if st else _why_no_stats(j)
        if reason is None and not base_stats:
            reason = "tensorwise: " + (_why_no_stats(base) if base else "no job")
        for kind in KINDS:
            ours = None
            if reason is None:
                mine, theirs = kind_error(st, kind), kind_error(base_stats, kind)
                ours = theirs / mine if mine and theirs is not None else None
            setting = f"{recipe(j)} vs tensorwise: {kind}s"
            rows.append(compare(CLAIMS["finer_scales"], setting, ours, FINER, "x", reason))
    return Table(
        "Finer scales against one per tensor",
        COMPARISON_COLUMNS,
        rows,
        note="ours: tensorwise's mean error of the kind / this recipe's (above 1: the finer "
        "scales err less). Gradients mix two effects: the finer scales, and e4m3 against "
        "tensorwise's e5m2.",
    )


def block_table(jobs: list[Job]) -> Table:
    rows = []
    for j in _fp8_jobs(jobs):
        st = stats(j)
        if not st:
            continue
        by_block = casts(st)
        for block in blocks(st):
            cells = [
                fmt(mean_error([r for b, o, r in by_block if b == block and o == op]))
                for op in OPERANDS
            ]
            rows.append((recipe(j), block, *cells))
    return Table(
        "Quantisation error per block and operand",
        ("recipe", "block", *OPERANDS),
        rows,
        note="Mean relative L2 error over the block's linears (attention wq, wk, wv, wo; MLP "
        "w1, w2, w3) and the recorded steps. weight_t (in the input-gradient GEMM) and "
        "input_t, grad_output_t (in the weight-gradient GEMM) are cast with their scales along "
        "the other dimension. deepseek's input_t is the requantisation of the forward's fp8 "
        "copy alone (1x128 tiles into 128x1), and it casts no weight_t: its 128x128 blocks "
        "serve both GEMMs.",
    )


def blocks(st: dict) -> list[str]:
    """The blocks the stats cover, in order ("other" for a linear outside the blocks)."""
    found = {block_of(layer) for layer in st}
    return sorted(found, key=lambda b: (0, int(b)) if b.isdigit() else (1, 0))


def saturation_table(jobs: list[Job]) -> Table:
    rows = []
    for j in _fp8_jobs(jobs):
        st = stats(j)
        for kind in KINDS:
            of_kind = casts_of_kind(st, kind) if st else []
            if not of_kind:  # nothing of the kind cast: no count of 0 to call "holds"
                reason = f"no {kind} cast recorded" if st else _why_no_stats(j)
                setting = f"{recipe(j)}: {kind}s"
                rows.append(compare(CLAIMS["no_saturation"], setting, None, 0, "", reason))
                continue
            saturated = sum(r["saturated"] for r in of_kind)
            worst = max(r["saturated_fraction"] for r in of_kind)
            setting = f"{recipe(j)}: {kind}s (largest fraction of one operand {fmt(worst)})"
            rows.append(compare(CLAIMS["no_saturation"], setting, saturated, 0))
    return Table(
        "Saturation",
        COMPARISON_COLUMNS,
        rows,
        note="Every recipe here scales each group by its own current amax (max |x| maps to "
        "the format's maximum, 448 for e4m3, 57,344 for e5m2), so no value can pass the "
        "maximum: anything but 0 is a bug. Delayed scaling (an older step's amax) is where "
        "saturation would happen; none of these recipes uses it.",
    )


def underflow_table(jobs: list[Job]) -> Table:
    rows = []
    for j in _fp8_jobs(jobs):
        st = stats(j)
        if not st:
            rows.append((recipe(j), *["-"] * len(KINDS), _why_no_stats(j)))
            continue
        cells = []
        for kind in KINDS:
            of_kind = casts_of_kind(st, kind)
            under = sum(r.get("underflowed", 0) for r in of_kind)
            worst = max(r.get("underflowed_fraction", 0) for r in of_kind)
            cells.append(f"{fmt(under)} (largest fraction {fmt(worst)})")
        rows.append((recipe(j), *cells, ""))
    return Table(
        "Underflow",
        ("recipe", *(f"{k}s" for k in KINDS), "note"),
        rows,
        note="Nonzero elements cast to zero (their group's scale too coarse for them), summed "
        "over every linear, operand of the kind and recorded call; the fraction is of one "
        "operand's elements, the largest of any. No claim: where it is large, finer scales "
        "should shrink it.",
    )


def error_tables(jobs: list[Job]) -> list[Table]:
    return [kind_table(jobs), finer_table(jobs), block_table(jobs), underflow_table(jobs)]


def error_plot(jobs: list[Job]):
    fig, axes = plt.subplots(1, len(KINDS), figsize=(10, 3.4), sharey=True)
    for ax, kind in zip(axes, KINDS, strict=True):
        for j in _fp8_jobs(jobs):
            st = stats(j)
            if not st:
                continue
            by_block = casts(st)
            errors = [
                mean_error([r for b, _, r in by_block if b == block and r["kind"] == kind])
                for block in blocks(st)
            ]
            ax.semilogy(blocks(st), errors, "o-", label=recipe(j), color=COLOURS[recipe(j)])
        ax.set_title(f"{kind}s")
        ax.set_xlabel("block")
    axes[0].set_ylabel("mean relative quantisation error")
    if axes[0].lines:
        axes[0].legend()
    fig.suptitle("fp8 quantisation error per block and tensor kind")
    fig.tight_layout()
    return fig
