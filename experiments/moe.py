"""Mixture of experts against dense models on one token budget: llama-tiny (dense SwiGLU,
d_ff 192), moe-tiny (8 SwiGLU experts of width 96, top 2: the same active parameters) under
three balancing schemes, and llama-tiny as wide as all the experts together (d_ff 768: the
MoE's total parameters), each over seeds. Per variant: tokens to reach the dense model's
final training loss (interpolated on the smoothed loss curves, seed by seed), median
tokens/s, peak memory, total and active parameters; the expert load over the run (each
logged step's max/mean assignments per expert, averaged over layers) with Switch/GShard's
balance loss, without it, and with DeepSeek-V3's sigmoid router and balancing bias.
Verdicts against docs/references.md: Switch Transformer (7x faster to T5-Base's quality at
equal FLOPs per token), DeepSeekMoE (2B matches GShard 2.9B; the dense model of the MoE's
total size is its upper bound), the balance loss evens the load (Switch, GShard), the bias
alone does (DeepSeek-V3), and more evenly than the loss (Wang et al., 2024)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

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
from experiments.series import smoothed
from experiments.sweep import Job
from llm.models.args import ModelArgs
from llm.models.shapes import model_args

REFS = "docs/references.md"
SMOOTHING = 5  # training losses and loads: the mean of this many logged steps
MB = 2**20

# The variants, by what the report compares (role_of reads them from each job's config).
DENSE = "dense"  # dense at the MoE's active parameters (d_ff = top_k x d_expert)
WIDE = "dense_total"  # dense at the MoE's total parameters (d_ff = n_experts x d_expert)
AUX = "moe_aux"  # softmax router with the balance loss
NONE = "moe_none"  # no balancing: no balance loss, no bias
BIAS = "moe_bias"  # sigmoid router with the balancing bias, no balance loss
ROLES = (DENSE, WIDE, AUX, NONE, BIAS)
MOE_ROLES = (AUX, NONE, BIAS)
ROLE_NAMES = {
    DENSE: "dense, equal active",
    WIDE: "dense, equal total",
    AUX: "MoE, balance loss",
    NONE: "MoE, no balancing",
    BIAS: "MoE, sigmoid + bias",
}
INF = (1.0, math.inf)  # "at least 1x": the ratios below are arranged to read that way

CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "switch_speedup",
            "at equal FLOPs per token, Switch-Base with 64 experts reaches T5-Base's "
            "perplexity 7x faster in pre-training",
            "7x (up to 7x, T5-Base and T5-Large based)",
            f"Fedus, Zoph, Shazeer, 2022, JMLR 23(120), arXiv:2101.03961 ({REFS})",
            0.25,
            "tokens the dense model takes to its own final training loss / tokens the MoE "
            f"(balance loss) takes to that loss, smoothed over {SMOOTHING} logged steps and "
            "interpolated, seed by seed (the same batches), mean over seeds",
        ),
        Claim(
            "moe_faster",
            "at equal FLOPs per token, a sparse MoE reaches the dense model's quality in "
            "fewer tokens (the direction of Switch's speed-up)",
            ">= 1x",
            f"Fedus, Zoph, Shazeer, 2022, arXiv:2101.03961 ({REFS})",
            0.0,
            "the switch_speedup measurement; every seed must agree on the side of 1",
        ),
        Claim(
            "deepseekmoe_gshard",
            "DeepSeekMoE 2B (fine-grained experts, shared experts) matches GShard 2.9B, "
            "which has 1.5x the expert parameters and computation",
            "1.5x expert parameters and compute at equal quality",
            f"Dai et al., 2024, arXiv:2401.06066 ({REFS})",
            0.25,
            "needs a DeepSeekMoE layout and a GShard 1.5x as large; we run GShard-style "
            "top-2 routing only",
        ),
        Claim(
            "dense_upper_bound",
            "the dense model with the MoE's total parameters sets the upper bound of the MoE "
            "(DeepSeekMoE 2B nearly approaches it)",
            "MoE loss / dense-at-total loss >= 1",
            f"Dai et al., 2024, arXiv:2401.06066 ({REFS})",
            0.0,
            "final validation loss of the MoE (balance loss) / that of llama-tiny with "
            "d_ff = n_experts x d_expert, seed by seed, mean over seeds (the same lr for "
            "every model)",
        ),
        Claim(
            "aux_loss_balance",
            "the auxiliary balance loss keeps the load across experts even",
            "max/mean without / with the loss >= 1",
            f"Fedus et al., 2022 (eq. 4, alpha 0.01); Lepikhin et al., 2020, "
            f"arXiv:2006.16668 ({REFS})",
            0.0,
            "mean over the last half of the run of each logged step's max/mean assignments "
            "per expert (averaged over layers): softmax router without the loss / with it, "
            "seed by seed, mean over seeds",
        ),
        Claim(
            "bias_balance",
            "the per-expert bias alone (no auxiliary loss) keeps the load balanced",
            "max/mean without balancing / with the bias >= 1",
            f"DeepSeek-AI, 2024, DeepSeek-V3, arXiv:2412.19437, section 2.1.2 ({REFS})",
            0.0,
            "the same load measure: softmax router without balancing / sigmoid router with "
            "the bias (bias_update_rate), no loss",
        ),
        Claim(
            "bias_vs_aux_balance",
            "auxiliary-loss-free balancing (the bias) balances the load better than the "
            "auxiliary loss",
            "max/mean with the loss / with the bias >= 1",
            f"Wang et al., 2024, arXiv:2408.15664 ({REFS})",
            0.0,
            "the same load measure: softmax router with the balance loss / sigmoid router "
            "with the bias, no loss",
        ),
        Claim(
            "bias_vs_aux_quality",
            "the bias-balanced model reaches a better loss than one balanced by the "
            "auxiliary loss alone",
            "loss with the loss / with the bias >= 1",
            f"DeepSeek-AI, 2024, arXiv:2412.19437; Wang et al., 2024 ({REFS})",
            0.0,
            "final validation loss: softmax router with the balance loss / sigmoid router "
            "with the bias, no loss",
        ),
    )
}


SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def args_of(job: Job) -> ModelArgs:
    """The model the job trained: its registry shape with the config's shape keys and
    model.moe applied."""
    m = job.get("model") or {}
    shape = {k: m.get(k) for k in SHAPE_KEYS}
    return model_args(m.get("name", "llama-tiny"), **shape, moe=m.get("moe") or {})


def seed(job: Job) -> int:
    return int(job.get("train.seed", 0))


def _biased(moe) -> bool:
    """DeepSeek-V3's balancing: the sigmoid router's bias, moved after each step."""
    return moe.router == "sigmoid" and moe.bias_update_rate > 0


def role_of(job: Job, moe_shape: ModelArgs | None) -> str | None:
    """Which variant the job is (ROLES), or None for one the report does not compare."""
    a = args_of(job)
    if a.moe is None:
        if moe_shape is None or moe_shape.moe is None:
            return DENSE
        moe = moe_shape.moe
        width = moe.d_expert or moe_shape.d_ff
        if a.d_ff == moe.top_k * width:
            return DENSE
        return WIDE if a.d_ff == moe.n_experts * width else None
    if a.moe.aux_loss_coef > 0:
        return AUX
    if _biased(a.moe):
        return BIAS
    return NONE


def variant(job: Job) -> str:
    """The job's model in words: shape, MLP width or router and balancing."""
    a = args_of(job)
    name = job.get("model.name")
    if a.moe is None:
        return f"{name} (dense, d_ff {a.d_ff})"
    m = a.moe
    parts = [f"{m.router} router"]
    if m.aux_loss_coef > 0:
        parts.append(f"balance loss {m.aux_loss_coef:g}")
    if _biased(m):
        parts.append(f"bias rate {m.bias_update_rate:g}")
    if m.aux_loss_coef == 0 and not _biased(m):
        parts.append("no balancing")
    return f"{name} ({m.n_experts}x{m.d_expert or a.d_ff}, top {m.top_k}; {', '.join(parts)})"


def by_role(jobs: list[Job]) -> dict[str, list[Job]]:
    """The finished jobs of each compared variant, by seed."""
    done = [j for j in jobs if not j.failed]
    moe_shape = next((args_of(j) for j in done if args_of(j).moe is not None), None)
    out: dict[str, list[Job]] = defaultdict(list)
    for j in done:
        role = role_of(j, moe_shape)
        if role is not None:
            out[role].append(j)
    return {r: sorted(js, key=seed) for r, js in out.items()}


# --- loss curves ---------------------------------------------------------------------


def tokens_per_step(job: Job) -> float:
    return job.summary["tokens_seen"] / max(job.summary["steps"], 1)


def loss_curve(job: Job) -> list[tuple[int, float]]:
    return smoothed(job.metric("loss"), SMOOTHING)


def final_loss(job: Job) -> float | None:
    curve = loss_curve(job)
    return curve[-1][1] if curve else None


def step_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The step at which the curve first reaches ``target``, linear between logged steps."""
    for i, (s, v) in enumerate(curve):
        if v <= target:
            if i == 0:
                return float(s)
            s0, v0 = curve[i - 1]
            return s0 + (v0 - target) / (v0 - v) * (s - s0)
    return None


@dataclass
class Reach:
    """One seed: the dense run's final loss, and the tokens each run takes to reach it."""

    seed: int
    target: float
    dense_tokens: float
    tokens: float | None  # None: never reached within the run
    run_tokens: float  # the tokens the run trained on

    @property
    def speedup(self) -> float | None:
        return None if self.tokens is None else self.dense_tokens / self.tokens

    @property
    def bound(self) -> float:
        """The speed-up is below this when the run never reached the target."""
        return self.dense_tokens / self.run_tokens


def reaches(dense: list[Job], other: list[Job]) -> list[Reach]:
    """Seed by seed (the same seed: the same batches), tokens to the dense run's final loss."""
    theirs = {seed(j): j for j in dense}
    out = []
    for j in other:
        ref = theirs.get(seed(j))
        target = None if ref is None else final_loss(ref)
        if target is None or final_loss(j) is None:
            continue
        dense_step = step_to(loss_curve(ref), target)
        step = step_to(loss_curve(j), target)
        out.append(
            Reach(
                seed(j),
                target,
                dense_step * tokens_per_step(ref),
                None if step is None else step * tokens_per_step(j),
                j.summary["tokens_seen"],
            )
        )
    return out


def unreached(reach: list[Reach]) -> str | None:
    """'not reached in k of n seeds (< bound)', or None when every seed reached it."""
    missed = [r for r in reach if r.tokens is None]
    if not missed:
        return None
    bound = max(r.bound for r in missed)
    return f"not reached in {len(missed)} of {len(reach)} seeds (< {bound:.2f}x)"


def late_gap(dense: list[Job], other: list[Job]) -> float | None:
    """The smoothed training loss minus the same seed's dense one at the same step, over the
    second half of the run, mean over steps and seeds."""
    theirs = {seed(j): dict(loss_curve(j)) for j in dense}
    gaps = []
    for j in other:
        ref = theirs.get(seed(j))
        if ref is None:
            continue
        half = j.summary["steps"] / 2
        diffs = [v - ref[s] for s, v in loss_curve(j) if s > half and s in ref]
        if diffs:
            gaps.append(statistics.mean(diffs))
    return _mean(gaps)


def mean_band(curves: list[list[tuple[int, float]]]):
    """(steps, mean, lowest, highest) over the steps every curve has."""
    steps = sorted(set.intersection(*(set(dict(c)) for c in curves))) if curves else []
    values = [[dict(c)[s] for c in curves] for s in steps]
    return (
        steps,
        [statistics.mean(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


# --- expert load ---------------------------------------------------------------------


def imbalance(job: Job) -> list[tuple[int, float]]:
    """Each logged step's max/mean assignments per expert, averaged over the MoE layers."""
    return [
        (s, statistics.mean(layers.values()))
        for s, layers in job.metric("moe/max_over_mean")
        if isinstance(layers, dict) and layers
    ]


def late_imbalance(job: Job) -> float | None:
    """The mean imbalance over the logged steps of the run's second half."""
    rows = imbalance(job)
    if not rows:
        return None
    half = job.summary["steps"] / 2
    late = [v for s, v in rows if s > half] or [rows[-1][1]]
    return statistics.mean(late)


def late_shares(job: Job) -> list[float]:
    """Each expert's share of the assignments over the second half, sorted from the most
    loaded, averaged over layers (1/E each at perfect balance)."""
    half = job.summary["steps"] / 2
    per_layer: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s, layers in job.metric("moe/load"):
        if s > half and isinstance(layers, dict):
            for layer, experts in layers.items():
                for e, n in experts.items():
                    per_layer[layer][e] += n
    sorted_shares = []
    for experts in per_layer.values():
        total = sum(experts.values())
        if total:
            sorted_shares.append(sorted((n / total for n in experts.values()), reverse=True))
    if not sorted_shares:
        return []
    return [statistics.mean(col) for col in zip(*sorted_shares, strict=True)]


# --- per job -------------------------------------------------------------------------


def val_loss(job: Job) -> float | None:
    return job.summary.get("final_val_loss")


def peak_mb(job: Job) -> float | None:
    peak = job.summary.get("peak_memory_bytes")
    return None if peak is None else peak / MB


def states_mb(job: Job) -> float | None:
    """Parameters, gradients and optimizer states at their largest (the peak tracker)."""
    peaks = job.summary.get("memory_peak") or [None]
    p = peaks[0]
    if not p:
        return None
    return sum(p.get(f"{k}_max", p.get(k, 0)) for k in ("params", "grads", "optimizer_states")) / MB


def rss_mb(job: Job) -> float | None:
    rss = job.summary.get("process_peak_rss_bytes")
    return None if rss is None else rss / MB


def best_tps(js: list[Job]) -> float | None:
    """The highest of the seeds' median tokens/s: the run other processes slowed least."""
    values = [j.summary.get("tokens_per_sec") for j in js]
    return max((v for v in values if v), default=None)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _spread(values, digits: int = 3) -> str:
    """mean ± std (one value: itself)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _range(values, unit: str = "") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt(lo, unit) if lo == hi else f"{fmt(lo)}-{fmt(hi)}{unit}"


# --- claims --------------------------------------------------------------------------


def paired(a: list[Job], b: list[Job], value) -> list[float]:
    """value(a_s) / value(b_s) for every seed both have."""
    theirs = {seed(j): j for j in b}
    out = []
    for j in a:
        other = theirs.get(seed(j))
        if other is None:
            continue
        x, y = value(j), value(other)
        if x is not None and y:
            out.append(x / y)
    return out


def directional(claim: Claim, setting: str, per_seed: list[float], missing: str | None) -> tuple:
    """A ">= 1x" verdict from seed-by-seed ratios: their mean, unless the seeds fall on both
    sides of 1 (then the difference is within what the seeds vary by)."""
    if missing or not per_seed:
        return compare(claim, setting, None, INF, "x", missing or "no seed finished both runs")
    shown = f"{setting}; seeds {_range(per_seed, 'x')}"
    if min(per_seed) < 1 < max(per_seed):
        reason = f"the seeds disagree ({_range(per_seed, 'x')}): within the seed-to-seed spread"
        return compare(claim, shown, _mean(per_seed), INF, "x", reason)
    return compare(claim, shown, _mean(per_seed), INF, "x")


def _unfinished_roles(roles: dict, *needed: str) -> str | None:
    absent = [ROLE_NAMES[r] for r in needed if not roles.get(r)]
    return f"no finished run of: {', '.join(absent)}" if absent else None


def scale_reason(roles: dict) -> str | None:
    """How far this run is from Switch's, in the run's own numbers; None at the GPU scale
    (the MoE ran on a GPU), where Switch's speed-up is judged."""
    moe = roles.get(AUX) or roles.get(NONE) or roles.get(BIAS)
    if not moe:
        return "no MoE run finished"
    j = moe[0]
    if j.summary.get("device") == "cuda":
        return None
    a = args_of(j)
    return (
        f"Switch-Base: 64 experts, top-1, T5-Base size (~0.2B), hundreds of thousands of "
        f"steps on C4; here {a.moe.n_experts} experts, top-{a.moe.top_k}, {a.n_layers} layers, "
        f"{fmt(j.summary['n_active_params'])} active parameters, "
        f"{fmt(j.summary['tokens_seen'])} tokens of a CPU corpus"
    )


def claims_rows(roles: dict) -> list[tuple]:
    rows = []
    dense, aux = roles.get(DENSE, []), roles.get(AUX, [])
    reach = reaches(dense, aux)
    missed = unreached(reach)
    got = [r.speedup for r in reach if r.speedup is not None]
    setting = f"{ROLE_NAMES[AUX]} vs {ROLE_NAMES[DENSE]}, tokens to the dense final loss"
    missing = _unfinished_roles(roles, DENSE, AUX)
    reason = missing or scale_reason(roles) or (None if reach else "no seed finished both runs")
    if missed and not missing:
        # Never reached within the run: slower than the dense model, whatever the amount.
        switch = f"{NOT_COMPARABLE}: {reason}" if reason else DOES_NOT_HOLD
        rows.append(("switch_speedup", setting, missed, "7x", "-", switch))
        rows.append(("moe_faster", setting, missed, ">= 1x", "-", DOES_NOT_HOLD))
    else:
        rows.append(compare(CLAIMS["switch_speedup"], setting, _mean(got), 7.0, "x", reason))
        rows.append(directional(CLAIMS["moe_faster"], setting, got, missing))
    rows.append(
        compare(
            CLAIMS["deepseekmoe_gshard"],
            "DeepSeekMoE 2B vs GShard 2.9B",
            None,
            1.5,
            "x",
            "we run GShard-style routing only (top-2 of 8 experts, no fine-grained "
            "segmentation, no shared expert), so there is no DeepSeekMoE to set against a "
            "GShard 1.5x as large; measured instead: the GShard-style MoE against the dense "
            "models of its active and of its total size (dense_upper_bound and the table above)",
        )
    )
    rows.append(
        directional(
            CLAIMS["dense_upper_bound"],
            f"{ROLE_NAMES[AUX]} / {ROLE_NAMES[WIDE]}, final val loss",
            paired(aux, roles.get(WIDE, []), val_loss),
            _unfinished_roles(roles, AUX, WIDE),
        )
    )
    none, bias = roles.get(NONE, []), roles.get(BIAS, [])
    for key, a, b, names in (
        ("aux_loss_balance", none, aux, (NONE, AUX)),
        ("bias_balance", none, bias, (NONE, BIAS)),
        ("bias_vs_aux_balance", aux, bias, (AUX, BIAS)),
    ):
        rows.append(
            directional(
                CLAIMS[key],
                f"{ROLE_NAMES[names[0]]} / {ROLE_NAMES[names[1]]}, max/mean over the last half",
                paired(a, b, late_imbalance),
                _unfinished_roles(roles, *names),
            )
        )
    rows.append(
        directional(
            CLAIMS["bias_vs_aux_quality"],
            f"{ROLE_NAMES[AUX]} / {ROLE_NAMES[BIAS]}, final val loss",
            paired(aux, bias, val_loss),
            _unfinished_roles(roles, AUX, BIAS),
        )
    )
    return rows


# --- tables --------------------------------------------------------------------------


def variants_table(roles: dict) -> Table:
    dense = roles.get(DENSE, [])
    dense_tps = best_tps(dense)
    dense_val = _mean(val_loss(j) for j in dense)
    rows = []
    for role in ROLES:
        js = roles.get(role)
        if not js:
            continue
        first = js[0]
        tps = best_tps(js)
        val = _mean(val_loss(j) for j in js)
        if role == DENSE:
            tokens, speed, timed = "its own final loss", "1x", "1x"
        else:
            reach = reaches(dense, js)
            missed = unreached(reach)
            if not reach:
                tokens = speed = timed = "-"
            elif missed:
                tokens, speed, timed = missed, "-", "-"
            else:
                tokens = _range([round(r.tokens) for r in reach])
                ups = [r.speedup for r in reach]
                speed = f"{_mean(ups):.2f}x ({_range(ups, 'x')})"
                timed = f"{_mean(ups) * tps / dense_tps:.2f}x" if tps and dense_tps else "-"
        val_gap = train_gap = "-"
        if role != DENSE:
            if val is not None and dense_val is not None:
                val_gap = f"{val - dense_val:+.3f}"
            gap = late_gap(dense, js)
            train_gap = f"{gap:+.3f}" if gap is not None else "-"
        rows.append(
            (
                ROLE_NAMES[role],
                variant(first),
                len(js),
                fmt(first.summary["n_params"]),
                fmt(first.summary["n_active_params"]),
                _spread([val_loss(j) for j in js]),
                val_gap,
                train_gap,
                tokens,
                speed,
                fmt(tps, "", 4) if tps else "-",
                timed,
                fmt(_mean(peak_mb(j) for j in js)),
                fmt(_mean(states_mb(j) for j in js)),
                fmt(_mean(rss_mb(j) for j in js)),
            )
        )
    return Table(
        "Dense against MoE",
        (
            "variant",
            "model",
            "seeds",
            "params",
            "active params",
            "final val loss",
            "- dense's",
            "train loss - dense's, second half",
            "tokens to the dense final loss",
            "speed-up (tokens)",
            "median tokens/s, best seed",
            "speed-up (time)",
            "peak memory MB",
            "model states MB",
            "process RSS MB",
        ),
        rows,
        note="final val loss: mean ± std over seeds; - dense's: the mean's difference from the "
        "dense model's (equal active). train loss - dense's: the smoothed training loss minus "
        "the same seed's dense one at the same step, over the logged steps of the run's "
        "second half, mean over steps and seeds (the same batches, so their difficulty "
        "cancels). tokens: the first "
        f"point where the training loss, averaged over {SMOOTHING} logged steps, reaches the "
        "same seed's dense final (averaged) loss, interpolated between logged steps; the "
        "range over seeds. speed-up (tokens): dense's tokens to its own final loss / this "
        "variant's, mean (range) over seeds; speed-up (time): the same times the variant's "
        "tokens/s / dense's, each the highest of its seeds' medians (the Trainer's median "
        "over the steps after the third; the highest: the run other processes slowed least, "
        "the per-job table has every seed's). Memory: "
        "the peak tracker's largest step total (peak memory) and its params + grads + "
        "optimizer states at their largest (model states), the process's peak RSS; means over "
        "seeds. Times compare across jobs only on an otherwise idle machine.",
    )


def reach_table(roles: dict) -> Table:
    rows = []
    dense = roles.get(DENSE, [])
    for role in (WIDE, *MOE_ROLES):
        for r in reaches(dense, roles.get(role, [])):
            rows.append(
                (
                    ROLE_NAMES[role],
                    r.seed,
                    f"{r.target:.4f}",
                    fmt(round(r.dense_tokens)),
                    fmt(round(r.tokens)) if r.tokens is not None else "not reached",
                    f"{r.speedup:.2f}x" if r.speedup is not None else "-",
                )
            )
    return Table(
        "Tokens to the dense model's final training loss, seed by seed",
        ("variant", "seed", "dense final loss", "dense tokens", "variant's tokens", "speed-up"),
        rows,
        note="The same seed gives both runs the same batches in the same order. dense "
        "tokens: where the dense run's smoothed curve first reaches its own final value "
        "(before its last step when the curve dips below it earlier).",
    )


def load_table(roles: dict) -> Table:
    rows = []
    for role in MOE_ROLES:
        js = roles.get(role)
        if not js:
            continue
        curves = [imbalance(j) for j in js]
        first = [c[0][1] for c in curves if c]
        late = [late_imbalance(j) for j in js]
        end = [smoothed(c, SMOOTHING)[-1][1] for c in curves if len(c) >= SMOOTHING]
        highest = [max(v for _, v in c) for c in curves if c]
        shares = [late_shares(j) for j in js]
        top = [s[0] for s in shares if s]
        low = [s[-1] for s in shares if s]
        balance = [v for j in js for _, v in j.metric("moe/balance_loss")[-1:]]
        dropped = [v for j in js for _, v in j.metric("moe/dropped_share")[-1:]]
        n_experts = args_of(js[0]).moe.n_experts
        rows.append(
            (
                ROLE_NAMES[role],
                variant(js[0]),
                len(js),
                _spread(first),
                _spread(late),
                _spread(end),
                _spread(highest),
                f"{_mean(top):.3f}" if top else "-",
                f"{_mean(low):.3f}" if low else "-",
                f"{1 / n_experts:.3f}",
                _spread(balance),
                _spread(dropped),
            )
        )
    return Table(
        "Expert load",
        (
            "variant",
            "model",
            "seeds",
            "max/mean, first logged step",
            "max/mean, last half",
            f"max/mean, last {SMOOTHING} logged steps",
            "max/mean, highest step",
            "most loaded expert's share, last half",
            "least loaded expert's share",
            "even share",
            "balance loss, last step",
            "dropped share",
        ),
        rows,
        note="max/mean: a logged step's largest per-expert assignment count over the mean "
        "(1 = perfectly even), averaged over the MoE layers; mean ± std over seeds (the last "
        "half, the last logged steps: their mean per seed; the verdicts use the last half). "
        "Shares: each expert's share of the "
        "assignments over the run's second half, the most and the least loaded, averaged over "
        "layers and seeds. balance loss: Switch's E·Σ f_i·P_i (1 when even), logged whether or "
        "not it is trained on. Dropless routing: the dropped share is 0 unless a "
        "capacity_factor is set.",
    )


def jobs_detail(jobs: list[Job]) -> Table:
    rows = []
    for j in jobs:
        if j.failed:
            continue
        rows.append(
            (
                j.num,
                variant(j),
                seed(j),
                fmt(j.summary["n_params"]),
                fmt(j.summary["n_active_params"]),
                fmt(final_loss(j), "", 4),
                fmt(val_loss(j), "", 4),
                fmt(j.summary.get("tokens_per_sec"), "", 4),
                fmt(peak_mb(j)),
                fmt(states_mb(j)),
                fmt(rss_mb(j)),
            )
        )
    return Table(
        "Per job",
        (
            "job",
            "model",
            "seed",
            "params",
            "active params",
            f"final train loss (mean of {SMOOTHING} logged)",
            "final val loss",
            "median tokens/s",
            "peak memory MB",
            "model states MB",
            "process RSS MB",
        ),
        rows,
    )


def report(jobs: list[Job]) -> list[Table]:
    roles = by_role(jobs)
    return [
        variants_table(roles),
        reach_table(roles),
        load_table(roles),
        Table(
            "Claims",
            COMPARISON_COLUMNS,
            claims_rows(roles),
            note="Every ratio is taken seed by seed (the same seed: the same batches) and "
            "arranged so the claim reads '>= 1x'; ours is the mean over seeds. When the seeds "
            f"fall on both sides of 1 the verdict is '{NOT_COMPARABLE}': the difference is "
            "within the seed-to-seed spread. The bias claims compare a sigmoid router with the "
            "bias against softmax routers: the router differs as well as the balancing.",
        ),
        jobs_detail(jobs),
    ]


# --- plots ---------------------------------------------------------------------------


def _band(ax, xs, mean, low, high, label):
    (line,) = ax.plot(xs, mean, label=label)
    if low != high:
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)


def plots(jobs: list[Job]) -> dict:
    roles = by_role(jobs)
    fig, (whole, late) = plt.subplots(2, 1, figsize=(7, 7))
    target = _mean(final_loss(j) for j in roles.get(DENSE, []))
    last = 0.0
    for role in ROLES:
        js = roles.get(role)
        if not js:
            continue
        steps, mean, low, high = mean_band([loss_curve(j) for j in js])
        if not steps:
            continue
        tokens = [s * tokens_per_step(js[0]) for s in steps]
        last = max(last, tokens[-1])
        for ax in (whole, late):
            _band(ax, tokens, mean, low, high, f"{ROLE_NAMES[role]} ({len(js)} seeds)")
    for ax in (whole, late):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="dense final")
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"training loss (mean of {SMOOTHING} logged)")
    whole.set_title("Loss against tokens: mean over seeds, band lowest to highest")
    if whole.lines:
        whole.legend()
        # The second half, where the variants separate, with the y range it spans.
        late.set_xlim(last / 2, last)
        ys = [
            y
            for line in late.lines
            for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
            if x >= last / 2
        ]
        pad = 0.05 * (max(ys) - min(ys) or 1.0)
        late.set_ylim(min(ys) - pad, max(ys) + pad)
        late.set_title("The second half")
    fig.tight_layout()

    load, (curve_ax, share_ax) = plt.subplots(2, 1, figsize=(7, 7))
    for role in MOE_ROLES:
        js = roles.get(role)
        if not js:
            continue
        steps, mean, low, high = mean_band([smoothed(imbalance(j), SMOOTHING) for j in js])
        if steps:
            _band(curve_ax, steps, mean, low, high, f"{ROLE_NAMES[role]} ({len(js)} seeds)")
        shares = [s for s in (late_shares(j) for j in js) if s]
        if shares:
            cols = list(zip(*shares, strict=True))
            share_ax.plot(
                range(1, len(cols) + 1),
                [statistics.mean(c) for c in cols],
                marker="o",
                label=ROLE_NAMES[role],
            )
    curve_ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="even")
    curve_ax.set_xlabel("step")
    curve_ax.set_ylabel(f"max/mean load (mean of layers, {SMOOTHING} logged steps)")
    curve_ax.set_title("Expert load over the run: mean over seeds, band lowest to highest")
    curve_ax.legend()
    moe = roles.get(AUX) or roles.get(NONE) or roles.get(BIAS)
    if moe:
        share_ax.axhline(
            1 / args_of(moe[0]).moe.n_experts, color="grey", linestyle="--", linewidth=0.8
        )
    share_ax.set_xlabel("expert, most to least loaded")
    share_ax.set_ylabel("share of assignments, last half")
    if share_ax.lines:
        share_ax.legend()
    load.tight_layout()
    return {"moe_loss": fig, "moe_load": load}
