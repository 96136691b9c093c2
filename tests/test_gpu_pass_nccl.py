"""The GPU pass's nccl section without a GPU: its comparison with single, its sync counts by
step, its two-rank rows and its goals (each of which a row can miss), and its dry run on CPU
(gloo, world size 1 and 2) through the runner."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from benchmarks.gpu_pass import nccl
from benchmarks.gpu_pass.common import NOT_MEASURED
from benchmarks.gpu_pass.nccl_runs import NATIVE_SITE, SYNC_WARNING, Trace, native_syncs, traced
from benchmarks.gpu_pass.report import load

REPO = Path(__file__).resolve().parent.parent
DDP = nccl.WORLD_1[0]
REF = {1: 5.0, 2: 4.0, 3: 3.0}


def test_the_largest_relative_gap_over_every_step_and_none_for_a_run_cut_short():
    assert nccl.max_rel_diff(dict(REF), REF) == 0.0
    assert nccl.max_rel_diff({1: 5.0, 2: 4.1, 3: 3.0}, REF) == pytest.approx(0.1 / 4.0)
    assert nccl.max_rel_diff({1: 5.0, 2: 4.0}, REF) is None
    assert nccl.max_rel_diff(dict(REF), {}) is None


def test_a_row_within_and_outside_tolerance():
    within = nccl.row(DDP, "nccl", 1, {1: 5.0, 2: 4.0 * (1 + nccl.TOLERANCE / 2), 3: 3.0}, REF)
    outside = nccl.row(DDP, "nccl", 1, {1: 5.0, 2: 4.0 * (1 + 2 * nccl.TOLERANCE), 3: 3.0}, REF)
    short = nccl.row(DDP, "nccl", 1, {1: 5.0}, REF)
    assert within["within_tolerance"] is True and outside["within_tolerance"] is False
    assert short["within_tolerance"] is None and "differ from single's" in short["note"]


def _trace(syncs: dict[int, int]) -> Trace:
    return Trace(syncs={s: [f"llm/x.py:{s}"] * n for s, n in syncs.items()})


def test_syncs_are_averaged_over_non_logged_and_logged_steps_without_the_last():
    # log_every=5 over 20 steps: 1, 5, 10, 15 logged; 20 (the last) left out.
    trace = _trace({0: 7, 1: 4, 2: 1, 5: 2, 10: 2, 15: 2, 20: 9})
    quiet, logged, synced = nccl.sync_counts(trace, dry=False)
    assert quiet == pytest.approx(1 / 15)
    assert logged == pytest.approx((4 + 2 + 2 + 2) / 4)
    assert synced == "steps 2 (1) of 15, at llm/x.py:2 x1"
    assert nccl.sync_counts(_trace({0: 3, 5: 1}), dry=False)[2] is None
    assert nccl.sync_counts(trace, dry=True)[:2] == (nccl.NOT_ON_CPU, nccl.NOT_ON_CPU)


def test_a_sync_warning_is_counted_at_the_step_in_flight_with_its_line():
    with traced(count_syncs=False) as trace:
        trace.step = 3
        warnings.warn(SYNC_WARNING, stacklevel=1)
        warnings.warn(SYNC_WARNING, stacklevel=1)
        with pytest.warns(UserWarning, match="another"):
            warnings.warn("another warning", stacklevel=1)
    assert list(trace.syncs) == [3] and len(trace.syncs[3]) == 2
    assert trace.syncs[3][0].startswith("tests/test_gpu_pass_nccl.py:")


def test_a_sync_warning_cpp_prints_itself_is_counted_at_the_step_it_was_printed_in():
    line = f"[W CUDAFunctions.cpp:162] Warning: {SYNC_WARNING} (function warn)\n".encode()
    trace = Trace()
    with native_syncs(trace) as mark:
        os.write(2, line)
        mark(1)
        os.write(2, b"another line\n" + line + line)
        mark(2)
    assert {s: len(sites) for s, sites in trace.syncs.items()} == {0: 1, 1: 2}
    assert trace.syncs[1] == [NATIVE_SITE, NATIVE_SITE]


def _gpu_row(strategy=DDP, diff=0.0, quiet=0.0, ran=True) -> dict:
    r = nccl.row(strategy, "nccl", 1, {1: 5.0 * (1 + diff)} if ran else None, {1: 5.0})
    if ran:
        r.update(syncs_per_non_logged_step=quiet, syncs_per_logged_step=1.0)
    return r


def _verdicts(rows: list[dict], dry: bool = False) -> list:
    return [g.met for g in nccl.goals(rows, dry)]


def test_the_goals_are_met_missed_not_judged_and_not_measured():
    assert _verdicts([_gpu_row()]) == [True, True]
    assert _verdicts([_gpu_row(diff=0.1)]) == [False, True]
    assert _verdicts([_gpu_row(quiet=1.0)]) == [True, False]
    # A world-size-1 strategy that did not run leaves every goal unjudged, never met.
    assert _verdicts([_gpu_row(), _gpu_row(nccl.WORLD_1[5], ran=False)]) == [None, None]
    nothing = nccl.goals([_gpu_row(ran=False)], dry=False)
    assert [g.value for g in nothing] == [NOT_MEASURED, NOT_MEASURED]
    # On CPU the syncs are not counted: that goal is not measured, whatever the rows.
    assert nccl.goals([_gpu_row()], dry=True)[1].value == NOT_MEASURED


def test_a_failed_run_misses_the_loss_goal():
    failed = {**nccl.row(DDP, "nccl", 1, None, REF, "failed: RuntimeError: boom"), "ran": True}
    goal = nccl.goals([_gpu_row(), failed], dry=False)[0]
    assert goal.met is False and "boom" in goal.value


def test_two_rank_rows_name_the_collective_gloo_failed_on():
    found = {
        "probe": {n: None for n in ("all_reduce", "broadcast", "all_gather", "all_to_all")}
        | {"reduce_scatter": "RuntimeError: no support for CUDA"},
        "runs": {"ddp": {"losses": {"1": 5.0}}, "zero1": {"skipped": ["reduce_scatter"]},
                 "zero2": {"error": "ValueError: bad"}},
    }  # fmt: skip
    rows, notes = nccl.pair_rows(found, {"gpt2-tiny": {1: 5.0}}, None, None, dry=False)
    by = {r["strategy"]: r for r in rows}
    assert by["ddp"]["within_tolerance"] is True
    assert by["zero1"]["note"] == (
        "not run: gloo on this device fails reduce_scatter: RuntimeError: no support for CUDA"
    )
    assert by["zero2"]["note"].startswith("failed:") and by["zero2"]["ran"]
    assert by["zero3"]["note"] == "not run: no result"
    assert "failed reduce_scatter (RuntimeError: no support for CUDA)" in notes[0]


def test_deepspeed_rows_say_why_it_did_not_import():
    rows, _ = nccl.pair_rows({}, {}, None, "not run: deepspeed does not import here (x)", False)
    assert {r["note"] for r in rows if "deepspeed" in r["strategy"]} == {
        "not run: deepspeed does not import here (x)"
    }


# About 80 s on 2 shared cores: five runs in this process, three on two spawned ranks.
@pytest.mark.slow
def test_the_dry_run_trains_every_kind_on_one_and_two_gloo_ranks_as_single_does(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_pass", "--only", "nccl", "--dry", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    log = (out / "gpu_pass.log").read_text() if (out / "gpu_pass.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + log[-3000:]
    result = load(out)["sections"]["nccl"]["result"]
    rows = {(r["strategy"], r["world_size"]): r for r in result["rows"]}
    wanted = {(s.label, 1) for s in nccl.WORLD_1 if s.dry} | {
        (s.label, 2) for s in nccl.WORLD_2 if s.dry
    }
    assert wanted <= set(rows)
    for key in wanted:
        assert rows[key]["steps"] == nccl.DRY["steps"], key
        assert rows[key]["within_tolerance"] is True, (key, rows[key])
        assert rows[key]["syncs_per_non_logged_step"] in (nccl.NOT_ON_CPU, None)
    assert [g["met"] for g in result["goals"]] == [True, None]
