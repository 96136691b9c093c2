"""FlashAttention (Dao et al., 2022 and 2023): the bytes attention keeps for backward
against sequence length, quadratic for eager and linear for flash kernels, and the papers'
memory saving (10x at 2K, 20x at 4K); speed against eager and SDPA, judged on a GPU only."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict

import matplotlib.pyplot as plt

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, fmt
from experiments.sweep import Job

SOURCE = "Dao et al., 2022, arXiv:2205.14135; Dao, 2023, arXiv:2307.08691 (docs/references.md)"
MAPPING = (
    "attention's saved bytes at the step's peak (summary.json memory_peak[0]"
    ".activations_attention, every layer) "
)
FLASH = ("sdpa", "flex", "triton", "flash_attn")  # the flash kernels (sdpa's flash on CPU)
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "eager_quadratic",
            "standard attention's memory is quadratic in T",
            "x4 per doubling of T",
            SOURCE,
            0.10,
            MAPPING + "at 2T / at T",
        ),
        Claim(
            "flash_linear",
            "FlashAttention's memory is linear in T",
            "x2 per doubling of T",
            SOURCE,
            0.05,
            MAPPING + "at 2T / at T",
        ),
        Claim(
            "saving_2k",
            "10x less attention memory than standard attention at T = 2K",
            "10x",
            SOURCE,
            0.25,
            MAPPING + ": eager's / the flash kernel's at T = 2048",
        ),
        Claim(
            "saving_4k",
            "20x less at T = 4K",
            "20x",
            SOURCE,
            0.25,
            MAPPING + ": eager's / the flash kernel's at T = 4096",
        ),
        Claim(
            "speedup",
            "FlashAttention-2 is 2-4x faster than standard attention",
            "2-4x (248-338 vs 93-167 TFLOP/s, H100)",
            SOURCE,
            0.0,
            "eager's median step_time_s / the flash kernel's, same T (GPU only)",
        ),
    )
}
PAPER_SAVING = {2048: ("saving_2k", 10.0), 4096: ("saving_4k", 20.0)}


def backend(job: Job) -> str:
    return job.override("attention") or job.get("attention.backend")


def seq_len(job: Job) -> int:
    return int(job.get("data.seq_len"))


def attention_bytes(job: Job) -> float | None:
    if job.failed:
        return None
    return job.summary["memory_peak"][0].get("activations_attention")


def _step_time(job: Job) -> float | None:
    times = [t for s, t in job.metric("step_time_s") if s > 1] if not job.failed else []
    return statistics.median(times) if times else None


def _table(jobs: list[Job]) -> dict[str, dict[int, Job]]:
    out: dict[str, dict[int, Job]] = defaultdict(dict)
    for j in jobs:
        out[backend(j)][seq_len(j)] = j
    return out


def report(jobs: list[Job]) -> list[Table]:
    by = _table(jobs)
    growth, saving, speed = [], [], []
    for name, runs in by.items():
        claim = CLAIMS["eager_quadratic" if name == "eager" else "flash_linear"]
        expected = 4.0 if name == "eager" else 2.0
        ts = sorted(runs)
        for t, t2 in itertools.pairwise(ts):
            a, b = attention_bytes(runs[t]), attention_bytes(runs[t2])
            per_doubling = (b / a) ** (1 / math.log2(t2 / t)) if a and b else None
            growth.append(compare(claim, f"{name}, T {t} -> {t2}", per_doubling, expected, "x"))
    eager = by.get("eager", {})
    for name in by:
        if name not in FLASH:
            continue
        for t, j in sorted(by[name].items()):
            base = eager.get(t)
            a, b = (attention_bytes(base) if base else None), attention_bytes(j)
            ours = a / b if a and b else None
            if t in PAPER_SAVING:
                key, paper = PAPER_SAVING[t]
                saving.append(compare(CLAIMS[key], f"eager / {name}, T={t}", ours, paper, "x"))
            ta, tb = (_step_time(base) if base else None), _step_time(j)
            on_gpu = not j.failed and j.summary.get("device") == "cuda"
            reason = None if on_gpu else "CPU: the papers time GPU kernels (HBM vs SRAM)"
            speed.append(
                compare(
                    CLAIMS["speedup"],
                    f"eager / {name}, T={t}",
                    ta / tb if ta and tb else None,
                    (2.0, 4.0),
                    "x",
                    reason,
                )
            )
    rows = [
        (name, t, fmt(attention_bytes(j)), fmt(_step_time(j)), "failed" if j.failed else "ok")
        for name, runs in by.items()
        for t, j in sorted(runs.items())
    ]
    return [
        Table("Attention's saved bytes per doubling of T", COMPARISON_COLUMNS, growth),
        Table("Memory saving of the flash kernel", COMPARISON_COLUMNS, saving),
        Table("Speed against eager", COMPARISON_COLUMNS, speed),
        Table(
            "Per job",
            ("attention", "T", "attention bytes", "median step s", "status"),
            rows,
            note="attention bytes: every layer's, at the step's peak; step time includes the "
            "whole model, not attention alone.",
        ),
    ]


def plots(jobs: list[Job]) -> dict:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in _table(jobs).items():
        pts = [(t, attention_bytes(j)) for t, j in sorted(runs.items()) if attention_bytes(j)]
        if pts:
            ts, bs = zip(*pts, strict=True)
            ax.loglog(ts, [b / 2**20 for b in bs], "o-", label=name, base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("attention's saved MiB (all layers)")
    ax.set_title("Attention memory against T")
    if ax.lines:
        ax.legend()
    return {"flash_attention": fig}
