"""The GPU pass's rehearse section (benchmarks/gpu_pass/rehearse.py) on CPU: the estimator
against one rehearsed rank at llama3-8b's proportions (a vocabulary 32 times the width),
where the loss's backward sets a sharded rank's peak, and the section's goals."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.gpu_pass import rehearse as section

SHARDED = {"fsdp": ("parallelism=fsdp",), "zero3": ("parallelism=zero3",)}


@pytest.mark.parametrize("layout", ["fsdp", pytest.param("zero3", marks=pytest.mark.slow)])
def test_the_estimate_is_the_rehearsed_peak_where_the_loss_sets_it(tmp_path, layout):
    """Every activation is still saved at the loss's backward, beside its two fp32 gradients
    of the logits' size and the gathered root: the rank's peak, which the estimate prices
    (a third under without it)."""
    case = section.Case(
        f"small llama {layout} x4",
        4,
        (*section.SMALL_LLAMA, "model.n_layers=2", "train.micro_batch_size=1", *SHARDED[layout]),
    )
    section.small_corpus(tmp_path)
    est = section.estimate_for(tmp_path, case, dry=True)
    figures = section.rehearse_rank(tmp_path, case, est.rank, dry=True, timeout_s=600)
    row = section.row(case, est, figures)
    assert row["states_equal"]
    assert row["tracked_phase"] == est.peak_moment == "backward"
    assert "loss_backward" in est.peak_rows
    assert abs(row["tracked_error_pct"]) < 0.5, (est.peak_rows, figures["memory_peak"])


PIPELINES = {  # world, the last stage's first rank, the layout
    "pp2": (2, 1, ("parallelism=single", "parallelism.pp_size=2", "model.n_layers=4")),
    "3D": (8, 4, ("parallelism=zero1", "parallelism.tp_size=2", "parallelism.pp_size=2",
                  "parallelism.dp_size=2", "model.n_layers=8")),
}  # fmt: skip


@pytest.mark.slow  # about 20 s each on 2 cores
@pytest.mark.parametrize("layout", sorted(PIPELINES))
def test_the_last_pipeline_stage_holds_its_micro_batchs_loss_backward(tmp_path, layout):
    """The last stage's peak is its micro-batch's loss backward beside its in-flight
    activations: two fp32 tensors of the logits' size, three under tensor parallel's
    loss_parallel (over 1/tp of the vocabulary). The rest of ``other`` is the stage outputs'
    gradients and small tensors, so the estimate is a little under."""
    world, rank, extra = PIPELINES[layout]
    case = section.Case(layout, world, (*section.SMALL_LLAMA, "train.micro_batch_size=2", *extra))
    section.small_corpus(tmp_path)
    est = section.estimate_for(tmp_path, case, dry=True)
    stage = next(s for s in est.stages if s.rank == rank)
    figures = section.rehearse_rank(tmp_path, case, rank, dry=True, timeout_s=600)
    assert stage.device["loss_backward"] > 0
    assert stage.total == pytest.approx(figures["memory_peak"]["total"], rel=0.015)


def _row(**more) -> dict:
    return {"states_equal": True, "tracked_error_pct": 1.0, "allocator_error_pct": 2.0, **more}


def test_the_goals_are_unmeasured_without_rows_and_can_be_missed():
    none = section._goals([], [], dry=False)
    assert all(g.met is None for g in none)
    assert all(g.met for g in section._goals([_row()], [], dry=False))
    states, total = section._goals([_row(), _row(states_equal=False)], [], dry=False)
    assert states.met is False and total.met is True
    _, total = section._goals([_row(allocator_error_pct=-3.5)], [], dry=False)
    assert total.met is False
    failed = section._goals([_row()], ["llama3-8b 3D x512: RuntimeError: ..."], dry=False)
    assert not any(g.met for g in failed)
    # Every case failed (the H200's first rehearse record): missed, not "not measured".
    every = section._goals([], ["fsdp x64: TypeError", "3D x512: TypeError"], dry=False)
    assert [g.met for g in every] == [False, False]
    assert all(g.value == "no case ran: 2 failed" for g in every)


def test_a_dry_run_judges_the_states_but_not_the_totals():
    states, total = section._goals([_row(tracked_error_pct=40.0)], [], dry=True)
    assert states.met is True and total.met is None


def test_the_gpu_cases_are_the_issues_sizes():
    """llama3-8b under fsdp on 64 ranks and in 3D (tp 8 x pp 8 x dp 8) on 512."""
    sizes = {c.world: c for c in section.GPU}
    assert set(sizes) == {64, 512}
    assert all("model=llama3-8b" in c.overrides for c in section.GPU)
    three_d = dataclasses.asdict(sizes[512])["overrides"]
    assert {"parallelism.tp_size=8", "parallelism.pp_size=8", "parallelism.dp_size=8"} <= set(
        three_d
    )


def test_a_failed_rehearsal_says_its_error_not_hydras_hint():
    traceback = "Traceback (most recent call last):\n  File x\nRuntimeError: fake pg: no shutdown\n"
    assert section.failure(traceback) == "RuntimeError: fake pg: no shutdown"
    ours = "step 1/4\nerror: gradients were not finite 3 steps in a row; lower optimizer.lr\n"
    assert section.failure(ours + "W1128 a warning after it\n").startswith("error: gradients")
    assert section.failure("") == "no output"
