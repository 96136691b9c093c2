"""experiments.claims: derived rows (arithmetic, no run) get their own verdict words and
tables, never "holds"; verdicts with nothing measured are "not comparable here"; moe's
Switch speed-up is judged at the GPU scale. Every derived row is shown agreeing and
disagreeing, every measured one holding and not."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import fp8_quantisation, grad_accumulation, moe, optimizers, zero_memory
from experiments import parallel_strategies_moe as ep
from experiments.claims import (
    COMPARISON_COLUMNS,
    DERIVED_COLUMNS,
    DOES_NOT_HOLD,
    FORMULA_AGREES,
    FORMULA_COLUMNS,
    FORMULA_DISAGREES,
    HOLDS,
    NOT_COMPARABLE,
    Claim,
    Table,
    claims_table,
    compare,
    derived_table,
)
from experiments.report import verdicts_line
from experiments.sweep import Job

MEASURED = Claim("m", "a measured claim", "1", "test", 0.1, "a run's number")
DERIVED = Claim("d", "a derived claim", "1", "test", 0.1, "our arithmetic", derived=True)


def _job(num: str, config: dict, summary: dict | None, metrics=()) -> Job:
    return Job(num, Path("."), [], config, summary, list(metrics))


# ---- the claims module ----------------------------------------------------------------
def test_a_derived_claim_agrees_or_disagrees_and_never_holds():
    assert compare(DERIVED, "s", 1.05, 1.0)[-1] == FORMULA_AGREES
    assert compare(DERIVED, "s", 1.2, 1.0)[-1] == FORMULA_DISAGREES
    assert compare(MEASURED, "s", 1.05, 1.0)[-1] == HOLDS
    assert compare(MEASURED, "s", 1.2, 1.0)[-1] == DOES_NOT_HOLD
    for claim in (MEASURED, DERIVED):  # nothing to judge: neither holds nor agrees
        assert compare(claim, "s", None, 1.0)[-1].startswith(NOT_COMPARABLE)


def test_derived_and_measured_rows_never_share_a_table():
    derived_row, measured_row = compare(DERIVED, "s", 1.0, 1.0), compare(MEASURED, "s", 1.0, 1.0)
    with pytest.raises(ValueError, match="derived rows: d"):
        Table("measured", COMPARISON_COLUMNS, [measured_row, derived_row])
    with pytest.raises(ValueError, match="measured rows: m"):
        derived_table("arithmetic", [derived_row, measured_row])
    table = derived_table("arithmetic", [derived_row], note="how it is computed")
    assert table.title == "arithmetic (derived: arithmetic, no run)"
    assert table.columns == DERIVED_COLUMNS and table.derived
    assert table.note.startswith("Derived, not measured") and table.note.endswith("computed")


def test_the_report_names_the_derived_verdicts_where_a_derived_table_is():
    measured = Table("measured", COMPARISON_COLUMNS, [compare(MEASURED, "s", 1.0, 1.0)])
    derived = derived_table("arithmetic", [compare(DERIVED, "s", 1.0, 1.0)])
    assert FORMULA_AGREES not in verdicts_line([measured])
    assert FORMULA_AGREES in verdicts_line([measured, derived])
    what = {row[0]: row[-1] for row in claims_table({"m": MEASURED, "d": DERIVED}).rows}
    assert what == {"m": "a run's number", "d": "derived, no run: our arithmetic"}


# ---- derived rows ---------------------------------------------------------------------
def test_zero_memory_figure1_is_derived_and_disagrees_when_the_estimator_is_off(monkeypatch):
    table = zero_memory.figure1_table()
    assert table.derived and [r[-1] for r in table.rows] == [FORMULA_AGREES] * 4
    real = zero_memory.paper_states

    def off(*args, **kwargs):  # stage 3's total 10% high, the others as computed
        states = real(*args, **kwargs)
        return type("Off", (), {"total": states.total * (1.1 if args[2] == 3 else 1.0)})

    monkeypatch.setattr(zero_memory, "paper_states", off)
    verdicts = [r[-1] for r in zero_memory.figure1_table().rows]
    assert verdicts == [FORMULA_AGREES] * 3 + [FORMULA_DISAGREES]


def test_grad_accumulation_counter_example_is_derived_and_agrees_on_equal_documents(
    monkeypatch,
):
    table = grad_accumulation.counter_example_table([2, 4])
    assert table.derived and [r[-1] for r in table.rows] == [FORMULA_DISAGREES] * 2
    # Documents of equal target tokens: the mean of micro-batch means is the per-token mean.
    monkeypatch.setattr(grad_accumulation, "DOC_LENGTHS", (64,) * 8)
    table = grad_accumulation.counter_example_table([2, 4])
    assert [r[-1] for r in table.rows] == [FORMULA_AGREES] * 2


# ---- measured against our formula ----------------------------------------------------
def _ep_job(num, strategy, ep_size, top_k=2, block=0, states=0):
    config = {
        "parallelism": {"name": strategy, "ep_size": ep_size},
        "launcher": {"nproc_per_node": 4},
        "model": {"name": "moe-tiny", "n_layers": 4, "moe": {"top_k": top_k, "n_experts": 8}},
        "train": {"micro_batch_size": 1},
        "data": {"seq_len": 64},
    }
    peak = {"params_max": states, "grads_max": 0, "optimizer_states_max": 0}
    summary = {
        "precision": "fp32",
        "device": "cpu",
        "activation_bytes_per_layer": [block],
        "memory_peak": [peak],
        "comm_bytes_per_step": [{"all_to_all": 1000}],
    }
    return _job(f"follow_up_1/{num}", config, summary)


@pytest.mark.parametrize("off", [1.0, 1.3])
def test_expert_parallel_memory_is_measured_against_our_formula(off):
    """Each row holds when the measurement is our formula's, and not when it is off."""
    shape = _ep_job(0, "zero2", 2)
    top2, top8 = (ep._formula_block(shape, k) for k in (2, 8))
    share = ep._expert_share(_ep_job(0, "ddp", 1))
    ep4 = round(10_000 * (1 - share * 3 / 4) * off)  # off: a smaller saving than the formula's
    jobs = [
        _ep_job(0, "zero2", 2, 2, block=round(top2 * off)),
        _ep_job(1, "zero2", 2, 8, block=top8),
        _ep_job(2, "ddp", 1, states=10_000),
        _ep_job(3, "ddp", 4, states=ep4),
    ]
    table = ep.formula_table(jobs)
    assert table.columns == FORMULA_COLUMNS and not table.derived
    expected = HOLDS if off == 1.0 else DOES_NOT_HOLD
    assert [(r[0], r[-1]) for r in table.rows] == [
        ("moe_activated", expected),
        ("moe_states", expected),
    ]


# ---- moe: Switch's 7x at the GPU scale ------------------------------------------------
DENSE = {"name": "llama-tiny", "d_ff": 192}
AUX = {"name": "moe-tiny", "moe": {"router": "softmax", "aux_loss_coef": 0.01}}


def _moe_run(model: dict, seed: int, rate: float, device: str) -> Job:
    """Training loss 6 - rate x step, logged at every one of 100 steps of 1,024 tokens."""
    summary = {"device": device, "steps": 100, "tokens_seen": 102_400, "n_active_params": 623_936}
    metrics = [{"step": s, "loss": 6.0 - rate * s} for s in range(1, 101)]
    config = {"model": model, "train": {"seed": seed}}
    return _job(f"{model['name']}{seed}", config, summary, metrics)


def _rate_for(speedup: float) -> float:
    """The MoE's loss slope that reaches the dense run's final loss ``speedup``x sooner:
    smoothed over 5 steps, dense's curve is 6 - 0.01 (s - 2), 5.02 at step 100."""
    return 0.98 / (100 / speedup - 2)


def _switch(speedup: float | None, device: str, seeds=((0, 0),)) -> tuple:
    """switch_speedup's row: dense and MoE seeds paired as given; None: never reached."""
    rate = 0.005 if speedup is None else _rate_for(speedup)
    jobs = []
    for dense_seed, moe_seed in seeds:
        jobs += [_moe_run(DENSE, dense_seed, 0.01, device), _moe_run(AUX, moe_seed, rate, device)]
    return next(r for r in moe.claims_rows(moe.by_role(jobs)) if r[0] == "switch_speedup")


@pytest.mark.parametrize(
    ("speedup", "expected"), [(7.0, HOLDS), (6.0, HOLDS), (2.0, DOES_NOT_HOLD)]
)
def test_switch_speedup_is_judged_at_the_gpu_scale(speedup, expected):
    row = _switch(speedup, "cuda")
    assert row[2] == f"{speedup:g}x" and row[-1] == expected


def test_switch_speedup_is_not_comparable_at_the_cpu_scale():
    row = _switch(7.0, "cpu")
    assert row[-1].startswith(f"{NOT_COMPARABLE}: Switch-Base")


def test_switch_speedup_never_reached_does_not_hold_on_a_gpu_and_needs_a_paired_seed():
    assert _switch(None, "cuda")[-1] == DOES_NOT_HOLD
    assert _switch(None, "cpu")[-1].startswith(f"{NOT_COMPARABLE}: Switch-Base")
    unpaired = _switch(7.0, "cuda", seeds=((0, 1),))
    assert unpaired[-1] == f"{NOT_COMPARABLE}: no seed finished both runs"


# ---- nothing measured: no verdict ------------------------------------------------------
def test_fp8_saturation_of_a_kind_with_no_cast_is_not_measured():
    def row(kind, saturated):
        return {"kind": kind, "calls": 1.0, "saturated": saturated, "saturated_fraction": 0.0}

    stats = {"layers.0.mlp.w2": {"input": row("activation", 0.0), "weight": row("weight", 3.0)}}
    config = {"precision": {"name": "fp8", "fp8_recipe": "rowwise"}}
    job = _job("0", config, {"fp8_stats": stats})
    rows = fp8_quantisation.saturation_table([job]).rows
    verdicts = {r[1].split(" (")[0]: r[-1] for r in rows}
    assert verdicts["rowwise: activations"] == HOLDS
    assert verdicts["rowwise: weights"] == DOES_NOT_HOLD
    assert verdicts["rowwise: gradients"] == f"{NOT_COMPARABLE}: no gradient cast recorded"


@pytest.mark.parametrize("adamw_steps", [2, 4])
def test_optimizers_speedup_without_adamws_loss_curve_is_not_measured(adamw_steps):
    """Muon never reaches AdamW's final loss: does not hold; but with AdamW's loss logged
    at fewer steps than one smoothing window there is no target to reach."""

    def run(num, opt, val, logged):
        config = {"optimizer": {"name": opt, "lr": 1e-3}}
        summary = {"final_val_loss": val, "steps": 1000, "tokens_seen": 1000, "n_params": 1}
        summary["model_state_bytes"] = [{"optimizer_states": 8}]
        metrics = [{"step": s, "loss": val + 1 / s} for s in range(1, logged + 1)]
        return Job(str(num), Path("."), [f"optimizer={opt}"], config, summary, metrics)

    jobs = [run(0, "adamw", 3.0, adamw_steps), run(1, "muon", 3.5, 4)]
    rows = {r[0]: r for r in optimizers.report(jobs)[1].rows}
    if adamw_steps >= optimizers.SMOOTHING:
        assert rows["muon_tokens"][2:] == ("not reached", "1.4x", "-", DOES_NOT_HOLD)
    else:
        reason = "adamw logged fewer than 3 training losses"
        assert rows["muon_tokens"][-1] == f"{NOT_COMPARABLE}: {reason}"
