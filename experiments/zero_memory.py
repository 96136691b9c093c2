"""ZeRO's model-state memory and communication per rank (Rajbhandari et al., 2019), for ddp,
our zero1-3, FSDP2 and DeepSpeed stages 1-3: the most params, the most grads and the most
optimizer states rank 0 held at any moment of its step, summed, against 16Φ, 4Φ + 12Φ/N,
2Φ + 14Φ/N, 16Φ/N (the step's peak beside them, with its phase, as information); the collectives' payload per step
against 2Φ (stages 0-2) and 3Φ (stage 3); and, derived (arithmetic, no run), the paper's
Figure 1 example from our estimator."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, derived_table, fmt
from experiments.sweep import Job
from llm.config import OptimizerConfig
from llm.estimate.states import paper_states
from llm.parallel.comm_units import comm_phi
from llm.precision import resolve_precision

SOURCE = "Rajbhandari et al., 2019, arXiv:1910.02054 (docs/references.md)"
MEMORY_TOLERANCE = 0.25  # bounded extras the paper does not count: docs/zero.md names them
PEAK_MAPPING = (
    "rank 0's highest step (summary.json memory_peak[0]): params_max + grads_max + "
    "optimizer_states_max, the most of each held at any moment of the step, bytes / Φ "
    "(Φ = n_params)"
)
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "stage0_memory",
            "DDP holds every model state",
            "16Φ",
            SOURCE,
            MEMORY_TOLERANCE,
            PEAK_MAPPING,
        ),
        Claim(
            "stage1_memory",
            "P_os partitions optimizer states",
            "4Φ + 12Φ/N",
            SOURCE,
            MEMORY_TOLERANCE,
            PEAK_MAPPING,
        ),
        Claim(
            "stage2_memory",
            "P_os+g partitions gradients too",
            "2Φ + 14Φ/N",
            SOURCE,
            MEMORY_TOLERANCE,
            PEAK_MAPPING,
        ),
        Claim(
            "stage3_memory",
            "P_os+g+p partitions parameters too",
            "16Φ/N",
            SOURCE,
            MEMORY_TOLERANCE,
            PEAK_MAPPING,
        ),
        Claim(
            "comm_stage0_2",
            "DDP and stages 1-2 move 2Φ elements per rank per step",
            "2Φ",
            SOURCE + ", section 7",
            0.10,
            "rank 0's comm_bytes_per_step in elements (all-reduce counted twice) / Φ",
        ),
        Claim(
            "comm_stage3",
            "stage 3 moves 3Φ (1.5x DDP)",
            "3Φ",
            SOURCE + ", section 7",
            0.10,
            "as above",
        ),
        Claim(
            "figure1",
            "Φ = 7.5B, N = 64: 120, 31.4, 16.6, 1.88 GB per rank",
            "120 / 31.4 / 16.6 / 1.88 GB",
            SOURCE + ", Figure 1",
            0.01,
            "llm.estimate.states.paper_states (the estimator's paper arithmetic), GB = 1e9 bytes",
            derived=True,
        ),
    )
}
# Bytes per parameter the paper counts at each stage, as (replicated, partitioned over N).
FORMULA = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}
FIGURE1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}


def stage(job: Job) -> int:
    name = job.get("parallelism.name")
    if name == "deepspeed":
        return int(job.get("parallelism.zero_stage", 0))
    return {"single": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[name]


def strategy_label(job: Job) -> str:
    return job.override("parallelism") or job.get("parallelism.name")


def ranks(job: Job) -> int:
    return int(job.get("launcher.nproc_per_node", 1))


def formula_phi(stage_: int, n: int) -> float:
    replicated, partitioned = FORMULA[stage_]
    return replicated + partitioned / n


STATES = ("params", "grads", "optimizer_states")


def most_states_phi(job: Job) -> float | None:
    """The most of each model state rank 0 held at any moment of its step, summed, in Φ:
    what the formula counts, whenever in the step each part is largest."""
    if job.failed:
        return None
    peak = job.summary["memory_peak"][0]
    return sum(peak[f"{k}_max"] for k in STATES) / job.summary["n_params"]


def steady_states_phi(job: Job) -> float | None:
    if job.failed:
        return None
    return sum(job.summary["model_state_bytes"][0].values()) / job.summary["n_params"]


def measured_comm_phi(job: Job) -> float | None:
    if job.failed or not job.summary.get("comm_bytes_per_step"):
        return None
    policy = resolve_precision(job.summary["precision"], torch.device(job.summary["device"]))
    return comm_phi(job.summary["comm_bytes_per_step"][0], policy, job.summary["n_params"])


def memory_table(jobs: list[Job]) -> Table:
    rows = []
    for j in jobs:
        s, n = stage(j), ranks(j)
        claim = CLAIMS[f"stage{s}_memory"]
        setting = f"{strategy_label(j)}, N={n} (stage {s})"
        rows.append(compare(claim, setting, most_states_phi(j), formula_phi(s, n), "Φ"))
    return Table(
        "Model states per rank, the most of each held in the step",
        COMPARISON_COLUMNS,
        rows,
        note="ours: the most params + the most grads + the most optimizer states rank 0 "
        "held at any moment of its highest step, in Φ (bytes / n_params); paper: the "
        "stage's formula at this N. The step peak's own states are in the next table.",
    )


BREAKDOWN_COLUMNS = (
    *("strategy", "N", "Φ", "most params", "most grads", "most optimizer states"),
    *("params at peak", "grads at peak", "optimizer states at peak", "steady state", "peak phase"),
)


def breakdown_table(jobs: list[Job]) -> Table:
    rows = []
    for j in jobs:
        if j.failed:
            rows.append((strategy_label(j), ranks(j), *["-"] * 8, "failed"))
            continue
        peak = j.summary["memory_peak"][0]
        phi = j.summary["n_params"]
        rows.append(
            (
                strategy_label(j),
                ranks(j),
                fmt(phi),
                *(fmt(peak[f"{k}_max"] / phi) for k in STATES),
                *(fmt(peak[k] / phi) for k in STATES),
                fmt(steady_states_phi(j)),
                peak["phase"],
            )
        )
    return Table(
        "By category (Φ): the most held in the step, and at the step's peak",
        BREAKDOWN_COLUMNS,
        rows,
        note="most: the largest bytes of that category at any moment of the step (at the "
        "end of backward for gradients, when the strategy has made them); at peak: at the "
        "moment of the step's highest total, which may fall before gradients exist; steady "
        "state: model_state_bytes after a step (what the strategy holds between steps).",
    )


def comm_table(jobs: list[Job]) -> Table:
    rows = []
    for j in jobs:
        s = stage(j)
        claim = CLAIMS["comm_stage3" if s == 3 else "comm_stage0_2"]
        paper = 3.0 if s == 3 else 2.0
        setting = f"{strategy_label(j)}, N={ranks(j)}"
        rows.append(compare(claim, setting, measured_comm_phi(j), paper, "Φ"))
    return Table("Communication per step", COMPARISON_COLUMNS, rows)


def figure1_table() -> Table:
    policy = resolve_precision("bf16", torch.device("cpu"))
    claim = CLAIMS["figure1"]
    rows = []
    for s, gb in FIGURE1_GB.items():
        ours = paper_states(7_500_000_000, 64, s, policy, OptimizerConfig(name="adamw")).total
        rows.append(compare(claim, f"stage {s}", ours / 1e9, gb, " GB"))
    return derived_table(
        "Figure 1: 7.5B parameters on 64 ranks",
        rows,
        note="ours: llm.estimate.states.paper_states at Φ = 7.5B, N = 64, bf16 and AdamW, "
        "the estimator's arithmetic for the paper's formulas; the measured model states are "
        "the first table's.",
    )


def report(jobs: list[Job]) -> list[Table]:
    return [memory_table(jobs), breakdown_table(jobs), comm_table(jobs), figure1_table()]


def plots(jobs: list[Job]) -> dict:
    ns = sorted({ranks(j) for j in jobs})
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        group = [j for j in jobs if ranks(j) == n]
        labels = [strategy_label(j) for j in group]
        x = range(len(group))
        ours = [most_states_phi(j) or 0.0 for j in group]
        paper = [formula_phi(stage(j), n) for j in group]
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="ours (most of each model state)")
        ax.bar([i + 0.2 for i in x], paper, 0.4, label="paper formula")
        for i, j in enumerate(group):
            if j.failed:
                ax.annotate("failed", (i - 0.2, 0.5), ha="center", rotation=90)
        ax.set_xticks(list(x), labels, rotation=45, ha="right")
        ax.set_ylabel("bytes per parameter (Φ)")
        ax.set_title(f"N = {n} ranks")
        ax.legend()
    fig.suptitle("ZeRO: model-state bytes per rank")
    return {"zero_memory": fig}
