"""bf16 stochastic rounding (``precision.update_rounding=stochastic``) against torchao's,
statistically: the rounding itself and many optimizer steps below half an ulp.

Ours is ``llm.optim.rounded_update._stochastic_round_`` (fp32 -> fp32 holding a bf16) under
``wrap_optimizer``; torchao 0.18.0's is ``torchao.optim.quant_utils._fp32_to_bf16_sr`` (private;
what its optimizers call under ``bf16_stochastic_round=True``) and ``torchao.optim._AdamW``
(its only AdamW with plain, unquantised state; there is no public ``torchao.optim.AdamW``).
torchao's optimizer step is ``torch.compile``d; here it runs eagerly
(``torch.compiler.set_stance("force_eager")``: the same Python, skipping a compile of seconds),
and the script below also runs it compiled (inductor's C++ backend on CPU).

Both are checked against the definition of stochastic rounding (and their drifts against each
other): |x| at fractional position f between its bf16 neighbours (f = the low 16 bits of x / 2^16, in units
of the neighbours' spacing, the ulp) rounds away from zero with probability f, so the error
(in ulps) is 1 - f with probability f and -f otherwise: mean 0, variance f(1 - f). Every
tolerance is 5 standard errors computed from that distribution (two-sided ~6e-7 per check);
the same checks reject truncation, round-to-nearest and a rounding biased by 1/256 ulp.

Print the tables of docs/optimizers.md:
``.venv/bin/python tests/test_stochastic_rounding_vs_torchao.py``
"""

from __future__ import annotations

import math

import pytest
import torch

from llm.optim import rounded_update
from llm.optim.rounded_update import wrap_optimizer

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.quant_utils import _fp32_to_bf16_sr  # noqa: E402

SIGMAS = 5.0
_HIGH_16 = -(1 << 16)  # 0xFFFF0000 as an int32: clears the bits below bf16's mantissa
_ULP = 1 << 16  # one bf16 ulp in fp32 bit-pattern units


# --- roundings: fp32 in, fp32 holding a bf16 out -------------------------------------------


def ours(x: torch.Tensor) -> torch.Tensor:
    return rounded_update._stochastic_round_(x.clone())


def torchao_sr(x: torch.Tensor) -> torch.Tensor:
    return _fp32_to_bf16_sr(x).float()


def nearest(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def truncation_(x: torch.Tensor) -> torch.Tensor:
    x.view(torch.int32).bitwise_and_(_HIGH_16)
    return x


def truncation(x: torch.Tensor) -> torch.Tensor:
    return truncation_(x.clone())


def biased_sr_(x: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding away from zero with probability min(f + 1/256, 1) (and 0 where
    f = 0): biased by 1/256 ulp."""
    noise = (torch.randint(0, _ULP, x.shape, dtype=torch.int32) + 256).clamp_(max=_ULP - 1)
    x.view(torch.int32).add_(noise).bitwise_and_(_HIGH_16)
    return x


def biased_sr(x: torch.Tensor) -> torch.Tensor:
    return biased_sr_(x.clone())


UNBIASED = {"ours": ours, "torchao": torchao_sr}
BIASED = {"truncation": truncation, "nearest": nearest, "sr biased 1/256 ulp": biased_sr}


def bf16_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """n nonzero fp32 values that are bf16s, both signs, magnitudes 2^-30 .. 2^30."""
    scale = torch.exp2(torch.randint(-30, 31, (n,), generator=gen).float())
    x = torch.randn(n, generator=gen) * scale
    return truncation_(x)


def position(x: torch.Tensor) -> torch.Tensor:
    """f: where |x| lies from its bf16 neighbour toward zero to the one away, in ulps."""
    return (x.view(torch.int32) & (_ULP - 1)).double() / _ULP


def rounded_away(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Whether r is x's bf16 neighbour away from zero; asserts it is one of the two."""
    toward = x.view(torch.int32) & _HIGH_16
    away = toward + _ULP  # the next bf16 in magnitude, either sign
    bits = r.view(torch.int32)
    assert bool(((bits == toward) | (bits == away)).all()), "not a neighbour of x"
    return bits == away


# --- 1. the rounding itself -----------------------------------------------------------------

# Positions in 2^-16 ulp: on a bf16, next to each neighbour, quarter points, just either side
# of halfway and halfway itself (where round-to-nearest breaks ties to even).
POSITIONS = (0, 1, 2, 1 << 8, 1 << 14, (1 << 15) - 1, 1 << 15, (1 << 15) + 1, 3 << 14)
POSITIONS += (_ULP - (1 << 8), _ULP - 2, _ULP - 1)


def up_counts(round_fn, n: int = 1 << 15, seed: int = 0):
    """For each position and sign: (f, sign, draws, times rounded away from zero), each of
    n values a different bf16 with that position added below its last bit."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = bf16_values(2 * n, gen).abs() * torch.tensor([1.0, -1.0]).repeat_interleave(n)
    rows = []
    for k in POSITIONS:
        x = (base.view(torch.int32) | k).view(torch.float32)
        away = rounded_away(x, round_fn(x))
        for s, half in (("+", away[:n]), ("-", away[n:])):
            rows.append((k / _ULP, s, n, int(half.sum())))
    return rows


def up_probability_failures(rows) -> list[str]:
    """Rows whose count is off f * draws by more than 5 standard errors plus 3 counts (the
    normal approximation is poor where draws * f is small: P(Poisson(0.5) >= 7) ~ 1e-6); a
    value already a bf16 (f = 0) must never move."""
    bad = []
    for f, s, n, ups in rows:
        bound = SIGMAS * math.sqrt(n * f * (1 - f)) + 3 if f > 0 else 0
        if abs(ups - n * f) > bound:
            bad.append(f"f={f:.6f}{s}: {ups}/{n}")
    return bad


def error_moments(round_fn, m: int = 4096, draws: int = 256, seed: int = 1) -> dict:
    """The rounding error in ulps (positive away from zero) of m random fp32 values, each
    rounded `draws` times, with the standard errors its definition predicts."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 31, (m,), generator=gen).float())
    x = torch.randn(m, generator=gen) * scale
    x = x[position(x) > 0]  # a value that is a bf16 has no error and no variance
    m = x.numel()
    xs = x.repeat(draws)
    f = position(x)
    e = (rounded_away(xs, round_fn(xs)).double() - position(xs)).view(draws, m)
    pq = f * (1 - f)
    out = {"m": m, "draws": draws}
    # Mean error, over all and per sign: each draw has variance pq.
    out["mean"] = e.mean().item()
    out["mean_se"] = math.sqrt(pq.sum().item()) / (m * math.sqrt(draws))
    for s, mask in (("+", x > 0), ("-", x < 0)):
        out[f"mean{s}"] = e[:, mask].mean().item()
        out[f"mean{s}_se"] = math.sqrt(pq[mask].sum().item()) / (mask.sum().item() * draws**0.5)
    # Variance across draws of one value, averaged over values, against the mean of pq; a
    # Bernoulli's sample variance has variance (mu4 - pq^2 (k-3)/(k-1)) / k, mu4 = pq(1-3pq).
    out["var"] = e.var(dim=0).mean().item()
    out["var_theory"] = pq.mean().item()
    var_of_var = (pq * (1 - 3 * pq) - pq**2 * (draws - 3) / (draws - 1)) / draws
    out["var_se"] = math.sqrt(var_of_var.sum().item()) / m
    # Bias of each value: z = sqrt(draws) * mean / sqrt(pq) has E z^2 = 1 and
    # Var z^2 = 2 + (1 - 6pq) / (draws pq) (a binomial's fourth moment).
    z2 = draws * e.mean(dim=0) ** 2 / pq
    out["chi2"] = z2.mean().item()
    out["chi2_se"] = math.sqrt((2 + (1 - 6 * pq) / (draws * pq)).sum().item()) / m
    return out


def moment_failures(s: dict) -> list[str]:
    checks = {
        "mean": abs(s["mean"]) <= SIGMAS * s["mean_se"],
        "mean+": abs(s["mean+"]) <= SIGMAS * s["mean+_se"],
        "mean-": abs(s["mean-"]) <= SIGMAS * s["mean-_se"],
        "var": abs(s["var"] - s["var_theory"]) <= SIGMAS * s["var_se"],
        "chi2": abs(s["chi2"] - 1) <= SIGMAS * s["chi2_se"],
    }
    return [k for k, ok in checks.items() if not ok]


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_rounds_away_from_zero_with_probability_the_position(name):
    assert up_probability_failures(up_counts(UNBIASED[name])) == []


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_rounding_error_is_unbiased_with_variance_f_1_minus_f(name):
    assert moment_failures(error_moments(UNBIASED[name])) == []


@pytest.mark.parametrize("name", sorted(BIASED))
def test_the_checks_reject_a_biased_rounding(name):
    assert up_probability_failures(up_counts(BIASED[name])) != []
    failed = moment_failures(error_moments(BIASED[name]))
    assert failed != []
    if name != "nearest":  # round-to-nearest is unbiased only over values, not per value
        assert "mean" in failed


# --- 2. many AdamW steps below half an ulp --------------------------------------------------

N, STEPS, LR = 16384, 64, 4e-4
H = 2.0**-7  # the bf16 ulp over [1, 2), where the weights stay: LR is 0.05 ulp


def start():
    """Weights: bf16s in [1.25, 1.75]; half move up (gradient -1), half down (+1)."""
    gen = torch.Generator().manual_seed(0)
    w0 = (1.25 + 0.5 * torch.rand(N, generator=gen)).bfloat16()
    grad = torch.tensor([1.0, -1.0]).repeat(N // 2)
    return w0, grad


def descend(
    make_optimizer,
    dtype: torch.dtype,
    seed: int = 0,
    stance: str = "force_eager",
    steady: bool = True,
) -> torch.Tensor:
    """STEPS AdamW steps (no weight decay) on a constant gradient of +-1, from Adam's steady
    state for it (m = g, v = 1, step 10^6 so both bias corrections are 1): every step moves
    the weight by exactly LR / (1 + eps) in fp32 state and bf16 state alike, so the
    difference from the fp32 run is the weight rounding alone. (``steady=False`` starts from
    a fresh state, betas (0.9, 0.999): there bf16's moments, rounded to nearest by ours and
    torchao's alike, add a drift of their own; the script prints it.)"""
    w0, grad = start()
    p = torch.nn.Parameter(w0.to(dtype))
    optimizer = make_optimizer([p])
    if steady:
        optimizer.state[p] = {
            "step": torch.tensor(1e6),
            "exp_avg": grad.to(dtype),
            "exp_avg_sq": torch.ones(N, dtype=dtype),
        }
    torch.manual_seed(seed)
    with torch.compiler.set_stance(stance):  # torchao's step compiles unless "default"
        for _ in range(STEPS):
            p.grad = grad.to(dtype)
            optimizer.step()
    return p.detach().double()


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False)


def ours_adamw(params):
    return wrap_optimizer(adamw(params), "stochastic")


def torchao_adamw(params, stochastic: bool = True):
    return torchao_optim._AdamW(params, lr=LR, weight_decay=0.0, bf16_stochastic_round=stochastic)


def torchao_adamw_nearest(params):
    return torchao_adamw(params, stochastic=False)


def fp32_reference() -> torch.Tensor:
    return descend(adamw, torch.float32)


def drift_stats(w: torch.Tensor, ref: torch.Tensor) -> dict:
    """The drift from the fp32 run, along each weight's motion: in ulps, e = (B - STEPS p)
    with B ~ Binomial(STEPS, p) the steps rounded onward, p = LR / H, so E e = 0 and
    Var e = STEPS p (1 - p); the sample variance of N such has relative standard error
    sqrt(2 / (N - 1) + kurtosis / N), a binomial's excess kurtosis (1 - 6pq) / (STEPS pq)."""
    w0, grad = start()
    e = (ref - w) * grad.double().sign() / H
    p = LR / H
    var_theory = STEPS * p * (1 - p)
    kurtosis = (1 - 6 * p * (1 - p)) / var_theory
    out = {
        "mean": e.mean().item(),
        "mean_se": math.sqrt(var_theory / N),
        "var": e.var().item(),
        "var_theory": var_theory,
        "var_rel_se": math.sqrt(2 / (N - 1) + kurtosis / N),
        "moved": (w != w0.double()).double().mean().item(),
    }
    for s, mask in (("up", grad < 0), ("down", grad > 0)):
        out[f"mean_{s}"] = e[mask].mean().item()
        out[f"mean_{s}_se"] = math.sqrt(var_theory / mask.sum().item())
    return out


def drift_failures(s: dict) -> list[str]:
    checks = {
        "mean": abs(s["mean"]) <= SIGMAS * s["mean_se"],
        "mean_up": abs(s["mean_up"]) <= SIGMAS * s["mean_up_se"],
        "mean_down": abs(s["mean_down"]) <= SIGMAS * s["mean_down_se"],
        "var": abs(s["var"] / s["var_theory"] - 1) <= SIGMAS * s["var_rel_se"],
    }
    return [k for k, ok in checks.items() if not ok]


@pytest.fixture(scope="module")
def reference():
    ref = fp32_reference()
    w0, grad = start()
    # The fp32 run moves every weight by STEPS * LR (within fp32 rounding: ~6e-8 a step).
    assert (ref - (w0.double() - STEPS * LR * grad.double())).abs().max() < 2e-5
    return ref


@pytest.mark.parametrize("name", ["ours", "torchao"])
def test_stochastic_rounding_tracks_the_fp32_run(reference, name):
    make = ours_adamw if name == "ours" else torchao_adamw
    assert drift_failures(drift_stats(descend(make, torch.bfloat16), reference)) == []


def test_ours_and_torchaos_drifts_agree(reference):
    a = drift_stats(descend(ours_adamw, torch.bfloat16, seed=1), reference)
    b = drift_stats(descend(torchao_adamw, torch.bfloat16, seed=2), reference)
    assert abs(a["mean"] - b["mean"]) <= SIGMAS * math.sqrt(2) * a["mean_se"]
    assert abs(math.log(a["var"] / b["var"])) <= SIGMAS * math.sqrt(2) * a["var_rel_se"]


@pytest.mark.parametrize("name", ["torch AdamW", "torchao"])
def test_round_to_nearest_stalls(reference, name):
    make = adamw if name == "torch AdamW" else torchao_adamw_nearest
    w = descend(make, torch.bfloat16)
    w0, _ = start()
    assert torch.equal(w, w0.double())  # every update is below half an ulp: none lands
    assert "mean" in drift_failures(drift_stats(w, reference))


@pytest.mark.parametrize("rounding", [truncation_, biased_sr_], ids=["truncation", "biased"])
def test_the_drift_checks_reject_a_biased_rounding(reference, monkeypatch, rounding):
    monkeypatch.setattr(rounded_update, "_stochastic_round_", rounding)
    failed = drift_failures(drift_stats(descend(ours_adamw, torch.bfloat16), reference))
    assert "mean" in failed or "mean_up" in failed


# --- the tables of docs/optimizers.md --------------------------------------------------------


def _tables() -> None:
    compiled_sr = torch.compile(_fp32_to_bf16_sr)
    roundings = {
        "ours (`_stochastic_round_`)": ours,
        "torchao `_fp32_to_bf16_sr`, eager": torchao_sr,
        "torchao `_fp32_to_bf16_sr`, compiled": lambda x: compiled_sr(x).float(),
        "round to nearest (`x.bfloat16()`)": nearest,
        "truncation": truncation,
        "stochastic, biased 1/256 ulp": biased_sr,
    }
    shown = (1, 1 << 14, 1 << 15, 3 << 14, _ULP - 1)
    print(
        "| rounding | P(away) at f = 2^-16, 1/4, 1/2, 3/4, 1-2^-16 | mean error (ulp) "
        "| variance (ulp²) | per-value bias χ²/dof | passes |"
    )
    print("|---|---|---|---|---|---|")
    for name, fn in roundings.items():
        rows = up_counts(fn)
        p = {k / _ULP: 0.0 for k in shown}
        for f, _, n, ups in rows:
            if f in p:
                p[f] += ups / (2 * n)
        s = error_moments(fn)
        ok = not up_probability_failures(rows) and not moment_failures(s)
        probs = ", ".join(f"{v:.4g}" for v in p.values())
        print(
            f"| {name} | {probs} | {s['mean']:+.5f} ± {s['mean_se']:.5f} "
            f"| {s['var']:.5f} ± {s['var_se']:.5f} (theory {s['var_theory']:.5f}) "
            f"| {s['chi2']:.3g} ± {s['chi2_se']:.2g} | {'yes' if ok else 'no'} |"
        )
    optimizers = {
        "ours: `wrap_optimizer(AdamW, 'stochastic')`": (ours_adamw, "force_eager"),
        "torchao `_AdamW(bf16_stochastic_round=True)`, eager": (torchao_adamw, "force_eager"),
        "torchao `_AdamW(bf16_stochastic_round=True)`, compiled": (torchao_adamw, "default"),
        "torchao `_AdamW(bf16_stochastic_round=False)`": (torchao_adamw_nearest, "force_eager"),
        "torch `AdamW` on bf16 params (round to nearest)": (adamw, "force_eager"),
    }
    for steady in (True, False):
        ref = descend(adamw, torch.float32, steady=steady)
        print()
        print(f"Adam state: {'steady' if steady else 'fresh'}")
        print("| optimizer | mean drift (ulp) | up / down movers | variance / theory | moved |")
        print("|---|---|---|---|---|")
        for name, (make, stance) in optimizers.items():
            w = descend(make, torch.bfloat16, stance=stance, steady=steady)
            s = drift_stats(w, ref)
            print(
                f"| {name} | {s['mean']:+.4f} ± {s['mean_se']:.4f} "
                f"| {s['mean_up']:+.4f} / {s['mean_down']:+.4f} "
                f"| {s['var'] / s['var_theory']:.3f} ± {s['var_rel_se']:.3f} "
                f"| {s['moved']:.1%} |"
            )
        if not steady:
            print(f"bf16 moments alone: {_moment_rounding_drift(ref):+.4f} ulp")
    p = LR / H
    print(f"theory: variance {STEPS * p * (1 - p):.4f} ulp², fp32 moves {STEPS * p:.3f} ulp")


def _moment_rounding_drift(ref: torch.Tensor) -> float:
    """The drift, from a fresh state, of fp32 weights whose AdamW moments are rounded to
    nearest bf16 after every step, as ours and torchao's both store them."""
    w0, grad = start()
    p = torch.nn.Parameter(w0.float())
    optimizer = adamw([p])
    for _ in range(STEPS):
        p.grad = grad.clone()
        optimizer.step()
        for key in ("exp_avg", "exp_avg_sq"):
            optimizer.state[p][key].copy_(optimizer.state[p][key].bfloat16())
    return drift_stats(p.detach().double(), ref)["mean"]


if __name__ == "__main__":
    _tables()
