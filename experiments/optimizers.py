"""Optimizers on one model, data and token budget, each over a learning-rate grid and
seeds: final validation loss at each one's best learning rate with its spread over seeds,
tokens to reach AdamW's final training loss, optimizer-state bytes per parameter, step
time, and loss curves at the best learning rates (the band: lowest to highest seed). Verdicts against
docs/references.md: Lion (half Adam's state, a 3-10x smaller learning rate), Adafactor
(O(n+m) state per matrix), 8-bit AdamW (a quarter of AdamW's state), Muon (1.4x fewer
tokens at 0.1B), Sophia (2x fewer steps than AdamW, on GPT-2 125M-770M) and
Kaddour et al., 2023 (no gain over a well-tuned AdamW)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import matplotlib.pyplot as plt

from experiments.claims import (
    COMPARISON_COLUMNS,
    DOES_NOT_HOLD,
    NOT_COMPARABLE,
    Claim,
    Table,
    compare,
    fmt,
)
from experiments.optimizers_sharded import is_sharded
from experiments.optimizers_sharded import report as sharded_report
from experiments.sweep import Job

REFS = "docs/references.md"
JUDGED_STEPS = 1000  # a CPU run this long (the medium scale) has its speed-ups judged
SHORT_RUN = (
    "the papers' runs are models of 0.1B parameters and more over 100K+ steps; this is a tiny "
    f"model for fewer than {JUDGED_STEPS} steps"
)
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "lion_state",
            "Lion keeps one momentum state, half of Adam's",
            "0.5x AdamW",
            f"Chen et al., 2023, arXiv:2302.06675 ({REFS})",
            0.05,
            "optimizer-state bytes per parameter (model_state_bytes[0].optimizer_states / "
            "n_params) / AdamW's",
        ),
        Claim(
            "lion_lr",
            "Lion needs a 3-10x smaller learning rate than AdamW",
            "3-10x",
            f"Chen et al., 2023, arXiv:2302.06675 ({REFS})",
            0.0,
            "AdamW's best lr / Lion's best lr on the grid (best: lowest final validation loss, "
            "mean over seeds); the grid's half-decade steps bound the resolution",
        ),
        Claim(
            "adafactor_state",
            "Adafactor's second moments are O(n+m) per n x m matrix, and it keeps no momentum",
            "O(n+m): far below AdamW's 8 bytes/parameter",
            f"Shazeer & Stern, 2018, arXiv:1804.04235 ({REFS})",
            0.0,
            "optimizer-state bytes per parameter / AdamW's, expected below 0.1",
        ),
        Claim(
            "adamw8bit_state",
            "8-bit AdamW keeps both moments in 8 bits, a quarter of AdamW's 32-bit state",
            "0.25x AdamW",
            f"Dettmers et al., 2022, arXiv:2110.02861 ({REFS})",
            0.10,
            "optimizer-state bytes per parameter / AdamW's; tensors under min_8bit_size "
            "(4096 elements: biases, norm gains) keep 32-bit moments, and each block of 256 "
            "a 32-bit scale",
        ),
        Claim(
            "sophia_steps",
            "Sophia reaches AdamW's loss in half the steps",
            "2x fewer steps",
            f"Liu et al., 2023, arXiv:2305.14342 ({REFS})",
            0.25,
            "steps AdamW takes to its final training loss / steps Sophia takes to the same "
            "loss, each at its best lr",
        ),
        Claim(
            "muon_tokens",
            "Muon (a matrix optimizer) reaches AdamW's loss with 1.4x fewer tokens at 0.1B "
            "parameters, 1.1x at 1.2B",
            "1.4x fewer tokens (0.1B)",
            f"Wen et al., 2025, 'Fantastic Pretraining Optimizers and Where to Find Them' "
            f"({REFS}, secondary)",
            0.25,
            "tokens AdamW takes to its final training loss / tokens Muon takes to the same "
            "loss, each at its best lr",
        ),
        Claim(
            "no_gain",
            "Lion and Sophia (and others) show no gain over a well-tuned AdamW at fixed compute",
            "best loss / AdamW's >= 1",
            f"Kaddour et al., 2023, arXiv:2307.06440 ({REFS})",
            0.01,
            "best final validation loss / AdamW's best (same tokens)",
        ),
    )
}


def name(job: Job) -> str:
    return job.override("optimizer") or job.get("optimizer.name")


def lr(job: Job) -> float:
    return float(job.get("optimizer.lr"))


def _by_optimizer_lr(jobs: list[Job]) -> dict[str, dict[float, list[Job]]]:
    out: dict[str, dict[float, list[Job]]] = defaultdict(lambda: defaultdict(list))
    for j in jobs:
        out[name(j)][lr(j)].append(j)
    return out


def _val(job: Job) -> float | None:
    return None if job.failed else job.summary.get("final_val_loss")


def best(runs: dict[float, list[Job]]) -> tuple[float, list[Job]] | None:
    """The lr with the lowest mean final validation loss over its finished seeds."""
    scored = []
    for value, seeds in runs.items():
        losses = [v for v in map(_val, seeds) if v is not None and math.isfinite(v)]
        if losses:
            scored.append((statistics.mean(losses), value, seeds))
    if not scored:
        return None
    _, value, seeds = min(scored)
    return value, [j for j in seeds if _val(j) is not None]


LR_BOUNDS = (1e-6, 1.0)  # the grid is not extended past these


def next_lr(value: float, up: bool) -> float:
    """The next point of the half-decade grid (1, 3, 10, 30, ... x 10^k) above or below."""
    exponent = math.floor(math.log10(value) + 1e-9)
    three = value / 10**exponent > 2  # the 3 of a decade, else its 1
    if up:
        return float(f"{value * (10 / 3 if three else 3):.0e}")
    return float(f"{value / (3 if three else 10 / 3):.0e}")


def follow_up(jobs: list[Job]) -> list[list[str]]:
    """One more grid point, at every seed, for each optimizer whose best lr is at an edge of
    the lrs it has run: the grid grows by half-decades until its best lr is inside it (an lr
    whose runs diverge, fail or end worse leaves the old edge inside), or reaches
    LR_BOUNDS."""
    out = []
    for opt, runs in _by_optimizer_lr(jobs).items():
        found = best(runs)
        if found is None or len(runs) < 2:
            continue
        value, lrs = found[0], sorted(runs)
        if value not in (lrs[0], lrs[-1]):
            continue
        candidate = next_lr(value, up=value == lrs[-1])
        if not LR_BOUNDS[0] <= candidate <= LR_BOUNDS[1] or candidate in runs:
            continue
        seeds = sorted({int(j.get("train.seed", 0)) for j in jobs if name(j) == opt})
        out.append(
            [
                f"optimizer={opt}",
                f"optimizer.lr={candidate:g}",
                f"train.seed={','.join(map(str, seeds))}",
            ]
        )
    return out


def state_per_param(job: Job) -> float | None:
    if job.failed:
        return None
    return job.summary["model_state_bytes"][0]["optimizer_states"] / job.summary["n_params"]


SMOOTHING = 3  # logged training losses averaged: one batch's loss is noisy


def smoothed_loss(job: Job) -> list[tuple[int, float]]:
    """(step, mean of this and the previous SMOOTHING - 1 logged training losses)."""
    rows = job.metric("loss")
    out = []
    for i in range(SMOOTHING - 1, len(rows)):
        window = [v for _, v in rows[i - SMOOTHING + 1 : i + 1]]
        out.append((rows[i][0], statistics.mean(window)))
    return out


def final_loss(job: Job) -> float | None:
    smoothed = smoothed_loss(job)
    return smoothed[-1][1] if smoothed else None


def steps_to(job: Job, target: float) -> int | None:
    """The first logged step whose smoothed training loss is at or below ``target``."""
    return next((s for s, v in smoothed_loss(job) if v <= target), None)


def _tokens_per_step(job: Job) -> float:
    return job.summary["tokens_seen"] / max(job.summary["steps"], 1)


def _step_time(job: Job) -> float | None:
    times = [t for s, t in job.metric("step_time_s") if s > 2]
    return statistics.median(times) if times else None


def _judged(jobs: list[Job]) -> bool:
    """On a GPU, or at least JUDGED_STEPS steps on a CPU."""
    done = [j for j in jobs if not j.failed]
    return any(j.summary.get("device") == "cuda" for j in done) or any(
        j.summary.get("steps", 0) >= JUDGED_STEPS for j in done
    )


def results_table(grid, bests, adamw_final) -> Table:
    rows = []
    for opt, runs in grid.items():
        b = bests.get(opt)
        if b is None:
            rows.append((opt, "-", "-", "-", "-", "-", "-", "every run failed or diverged"))
            continue
        value, seeds = b
        losses = [_val(j) for j in seeds]
        spread = f"± {statistics.stdev(losses):.3f}" if len(losses) > 1 else "1 seed"
        first = seeds[0]
        reach = None if adamw_final is None else steps_to(first, adamw_final)
        tokens = None if reach is None else reach * _tokens_per_step(first)
        tried = ", ".join(f"{v:g}" for v in sorted(runs))
        edge = " at the grid's edge" if value in (min(runs), max(runs)) else ""
        rows.append(
            (
                opt,
                f"{value:g}{edge} (of {tried})",
                f"{statistics.mean(losses):.4f}",
                spread,
                fmt(tokens) if tokens is not None else "not reached",
                fmt(state_per_param(first)),
                fmt(_step_time(first)),
                ", ".join(f"{j.num}" for j in seeds),
            )
        )
    return Table(
        "Each optimizer at its best learning rate",
        (
            "optimizer",
            "best lr",
            "final val loss",
            "spread over seeds",
            "tokens to AdamW's final loss",
            "state bytes/param",
            "median step s",
            "jobs",
        ),
        rows,
        note="best lr: lowest mean final validation loss over seeds; the grid is extended by "
        "half-decades while the best is at its edge, up to lr "
        f"{LR_BOUNDS[0]:g}-{LR_BOUNDS[1]:g} (at the grid's edge: the optimum may lie beyond "
        "it); tokens: the first logged step whose training loss, "
        f"averaged over {SMOOTHING} logged steps, is at or below AdamW's final (averaged) "
        "one; step times compare across jobs only on an otherwise idle machine.",
    )


def _speedup_row(jobs, key, opt, best_run, adamw_job, adamw_final, no_adamw, paper) -> tuple:
    """How many times fewer steps (tokens) ``opt`` needs to reach AdamW's final training
    loss than AdamW itself, each at its best lr: judged on a GPU and at the medium CPU scale,
    "not comparable" on the small scale's tiny model and few steps."""
    claim = CLAIMS[key]
    setting = f"{opt} vs adamw, {adamw_job.summary['steps'] if adamw_job else '?'} steps"
    reason = no_adamw or (None if _judged(jobs) else SHORT_RUN)
    if adamw_job is None or best_run is None:
        return compare(claim, setting, None, paper, "x", reason)
    # Without a smoothed curve "never reached" would be a verdict on nothing measured.
    short = [n for n, j in (("adamw", adamw_job), (opt, best_run[1][0])) if final_loss(j) is None]
    if short:
        why = f"{' and '.join(short)} logged fewer than {SMOOTHING} training losses"
        return compare(claim, setting, None, paper, "x", why)
    theirs = steps_to(best_run[1][0], adamw_final)
    if theirs is None:  # it never got to AdamW's loss: slower, not faster
        shown = f"{NOT_COMPARABLE}: {reason}" if reason else DOES_NOT_HOLD
        return (claim.key, setting, "not reached", f"{paper:g}x", "-", shown)
    ours = steps_to(adamw_job, adamw_final) / theirs
    return compare(claim, setting, ours, paper, "x", reason)


def report(jobs: list[Job]) -> list[Table]:
    if is_sharded(jobs):  # scale=sharded: no lr grid, strategies side by side
        return sharded_report(jobs)
    grid = _by_optimizer_lr(jobs)
    bests = {opt: b for opt, runs in grid.items() if (b := best(runs)) is not None}
    adamw = bests.get("adamw")
    adamw_job = adamw[1][0] if adamw else None
    adamw_final = final_loss(adamw_job) if adamw_job else None
    no_adamw = None if adamw else "no finished AdamW run"
    rows = []

    def state_ratio(opt: str) -> float | None:
        if opt not in bests or adamw_job is None:
            return None
        return state_per_param(bests[opt][1][0]) / state_per_param(adamw_job)

    if "lion" in grid:
        rows.append(
            compare(CLAIMS["lion_state"], "lion", state_ratio("lion"), 0.5, not_comparable=no_adamw)
        )
        lion_lr = bests["lion"][0] if "lion" in bests else None
        ratio = adamw[0] / lion_lr if adamw and lion_lr else None
        rows.append(
            compare(CLAIMS["lion_lr"], _lion_setting(grid), ratio, (3.0, 10.0), "x", no_adamw)
        )
    if "adafactor" in grid:
        rows.append(
            compare(
                CLAIMS["adafactor_state"],
                "adafactor",
                state_ratio("adafactor"),
                (0.0, 0.1),
                not_comparable=no_adamw,
            )
        )
    if "adamw8bit" in grid:
        rows.append(
            compare(
                CLAIMS["adamw8bit_state"],
                "adamw8bit",
                state_ratio("adamw8bit"),
                0.25,
                not_comparable=no_adamw,
            )
        )
    for opt, key, paper in (("sophia", "sophia_steps", 2.0), ("muon", "muon_tokens", 1.4)):
        if opt in grid:
            best_run = bests.get(opt)
            rows.append(
                _speedup_row(jobs, key, opt, best_run, adamw_job, adamw_final, no_adamw, paper)
            )
    for opt in grid:
        if opt == "adamw":
            continue
        b = bests.get(opt)
        ours = None
        if b and adamw:
            ours = statistics.mean(map(_val, b[1])) / statistics.mean(map(_val, adamw[1]))
        rows.append(
            compare(
                CLAIMS["no_gain"], f"{opt} vs adamw", ours, (1.0, math.inf), not_comparable=no_adamw
            )
        )
    return [
        results_table(grid, bests, adamw_final),
        Table(
            "Claims",
            COMPARISON_COLUMNS,
            rows,
            note="Every verdict but the state sizes depends on each optimizer's best lr: the "
            "grid's point with the lowest mean final validation loss, the grid extended by "
            "half-decades (follow-up sweeps) until that point is inside it.",
        ),
        lr_table(grid),
    ]


def _lion_setting(grid) -> str:
    """The weight decays the lr ratio was found with (the paper scales Lion's up 3-10x)."""
    decay = {
        opt: next(iter(runs.values()))[0].get("optimizer.weight_decay")
        for opt, runs in grid.items()
        if opt in ("lion", "adamw")
    }
    return (
        f"best lr on the grid, weight decay: Lion {decay.get('lion')}, AdamW {decay.get('adamw')}"
    )


def lr_table(grid) -> Table:
    lrs = sorted({v for runs in grid.values() for v in runs})
    rows = []
    for opt, runs in grid.items():
        cells = []
        for v in lrs:
            losses = [x for x in map(_val, runs.get(v, [])) if x is not None]
            failed = any(j.failed for j in runs.get(v, []))
            cells.append(
                f"{statistics.mean(losses):.3f}" if losses else ("failed" if failed else "-")
            )
        rows.append((opt, *cells))
    return Table(
        "Final validation loss over the grid", ("optimizer", *(f"lr {v:g}" for v in lrs)), rows
    )


def seed_band(seeds: list[Job]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, lowest, highest) of the seeds' smoothed training losses, over the
    steps every seed logged."""
    curves = [dict(smoothed_loss(j)) for j in seeds]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[s] for c in curves] for s in steps]
    return (
        steps,
        [statistics.mean(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


def plots(jobs: list[Job]) -> dict:
    if is_sharded(jobs):
        return {}
    grid = _by_optimizer_lr(jobs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for opt, runs in grid.items():
        b = best(runs)
        if b is None:
            continue
        steps, mean, low, high = seed_band(b[1])
        if not steps:
            continue
        (line,) = ax.plot(steps, mean, label=f"{opt} (lr {b[0]:g}, {len(b[1])} seeds)")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {SMOOTHING} logged steps)")
    ax.set_title("Each optimizer at its best lr: mean over seeds, band lowest to highest")
    if ax.lines:
        ax.legend()
    return {"optimizers": fig}
