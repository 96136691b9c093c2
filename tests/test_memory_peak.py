"""The peak-memory tracker: known allocations land in their category and phase, storages
resized in place are re-measured, `off` records nothing; and a training run reports it."""

from __future__ import annotations

import pytest
import torch

from llm.memory import CATEGORIES, PeakTracker, module_state_tensors
from tests.helpers import read_metrics, run

CPU = torch.device("cpu")
N = 1024  # elements of the parameter; 4 KiB in fp32


def _parts(peak: dict) -> int:
    return sum(peak[c] for c in CATEGORIES)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(N))
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)  # one momentum buffer per param
    tracker = PeakTracker(CPU, "alternate")
    tracker.watch(
        lambda: {
            "params": [weight],
            "grads": [weight.grad],
            "optimizer_states": [v for s in opt.state.values() for v in s.values()],
        }
    )
    return weight, opt, tracker


def _step(weight, opt, tracker, temp_elems: int = 0, forward_temp_elems: int = 0):
    x = torch.randn(N)  # made before the step: the tracker sees it only once saved
    with tracker.step(tracked=True):
        if forward_temp_elems:
            temp = torch.ones(forward_temp_elems)  # a temporary in the forward: "other"
            del temp
        act = weight * x  # an op output saved by the next op: an activation
        loss = (act * act).sum()
        tracker.phase("backward")
        tracker.watch_backward(loss)
        loss.backward()
        tracker.phase("optimizer_step")
        if temp_elems:
            temp = torch.ones(temp_elems)  # a temporary at the step: "other"
            del temp
        opt.step()
        opt.zero_grad(set_to_none=False)
    return tracker.last_step


def test_each_category_holds_its_known_allocation(setup):
    weight, opt, tracker = setup
    _step(weight, opt, tracker)  # creates the grad and the momentum buffer
    peak = _step(weight, opt, tracker, temp_elems=64 * N)
    assert peak["phase"] == "optimizer_step"
    assert peak["params"] == peak["grads"] == peak["optimizer_states"] == 4 * N
    assert peak["other"] >= 4 * 64 * N  # the temporary (plus SGD's own, if any)
    assert peak["total"] == _parts(peak)
    forward = tracker.by_phase["forward"]
    # x (saved by mul) and act (saved by the second mul) are held for backward at the peak.
    assert forward["activations"] == 2 * 4 * N
    assert forward["total"] == _parts(forward)


def test_gradients_made_during_backward_count_as_grads(setup):
    weight, _, tracker = setup
    with tracker.step(tracked=True):
        loss = (weight * 2).sum()  # saves nothing: the backward's peak holds the new grad
        tracker.phase("backward")
        tracker.watch_backward(loss)
        loss.backward()
    backward = tracker.by_phase["backward"]
    # Made by an op while unclassified, named by state_tensors() when backward ends.
    assert backward["grads"] == 4 * N
    assert backward["other"] < 4 * N
    assert tracker.totals["grads"] == 4 * N


def test_most_activations_are_kept_apart_from_the_peak(setup):
    """The step's peak falls at the optimizer's temporary, after backward freed the
    activations; activations_max is the most held at once (forward's two saved tensors),
    per phase and for the step."""
    weight, opt, tracker = setup
    _step(weight, opt, tracker)
    peak = _step(weight, opt, tracker, temp_elems=64 * N)
    assert peak["phase"] == "optimizer_step" and peak["activations"] == 0
    assert peak["activations_max"] == tracker.by_phase["forward"]["activations_max"] == 2 * 4 * N
    assert tracker.by_phase["optimizer_step"]["activations_max"] == 0


def test_most_grads_are_kept_when_the_peak_falls_before_any_gradient(setup):
    """A forward temporary sets the step's peak before backward makes the gradient (the
    first step: no gradient exists before it): the peak holds no gradient, grads_max holds
    it."""
    weight, opt, tracker = setup
    peak = _step(weight, opt, tracker, forward_temp_elems=64 * N)
    assert peak["phase"] == "forward" and peak["grads"] == 0
    assert peak["grads_max"] == 4 * N
    assert peak["optimizer_states_max"] == 4 * N  # the momentum buffer the step made
    assert peak["params_max"] == 4 * N
    assert tracker.by_phase["forward"]["grads_max"] == 0


def test_activations_are_released_after_backward(setup):
    weight, opt, tracker = setup
    _step(weight, opt, tracker)
    assert tracker.totals["activations"] == 0


def test_storage_resized_to_zero_and_back_is_remeasured():
    full = torch.zeros(N)
    tracker = PeakTracker(CPU, "alternate")
    tracker.watch(lambda: {"params": [full]})
    full.untyped_storage().resize_(0)  # freed before tracking began (ZeRO-3, FSDP2)
    with tracker.step(tracked=True):
        assert tracker.totals["params"] == 0
        full.untyped_storage().resize_(4 * N)  # gathered: no op output shows it
        assert tracker.totals["params"] == 4 * N
        full.untyped_storage().resize_(0)
        assert tracker.totals["params"] == 0
        tracker.phase("backward")
    peak = tracker.last_step
    assert peak["params"] == 4 * N and peak["phase"] == "forward"
    assert tracker.by_phase["backward"]["params"] == 0
    # Outside a window sizes are re-read when the next one opens.
    full.untyped_storage().resize_(4 * N)
    with tracker.step(tracked=True):
        assert tracker.totals["params"] == 4 * N


def test_a_saved_leaf_whose_storage_is_swapped_out_is_not_subtracted_twice():
    """DeepSpeed ZeRO-3 gathers a parameter into a fresh storage for forward and releases it
    with ``param.data = torch.empty(0)`` while autograd still holds the parameter."""
    weight = torch.nn.Parameter(torch.zeros(1))
    tracker = PeakTracker(CPU, "alternate")
    with tracker.step(tracked=True):
        weight.data = torch.randn(N) * 1.0  # gathered: an op output, so the tracker sees it
        x = torch.randn(N, requires_grad=True)
        loss = (weight * x).sum()  # saves the leaf weight (an activation now) and x
        assert tracker.totals["activations"] >= 4 * N
        weight.data = torch.empty(0)  # released: the gathered storage dies here
        tracker.phase("backward")
        weight.data = torch.randn(N) * 1.0  # gathered again for backward
        loss.backward()
    assert all(v >= 0 for v in tracker.totals.values()), tracker.totals
    assert tracker.last_step["activations"] >= 0


def test_peak_falls_in_the_phase_that_allocated_most():
    tracker = PeakTracker(CPU, "alternate")
    with tracker.step(tracked=True):
        small = torch.ones(N)
        tracker.phase("backward")
        big = torch.ones(8 * N)
        del big
        tracker.phase("optimizer_step")
        mid = torch.ones(2 * N)
        del small, mid
    assert tracker.last_step["phase"] == "backward"
    assert tracker.last_step["other"] == 4 * 9 * N
    assert tracker.by_phase["optimizer_step"]["other"] == 4 * 3 * N


def test_regions_are_phases_of_their_own():
    tracker = PeakTracker(CPU, "logged")
    with tracker.region("checkpoint_save"):
        buf = torch.ones(N)
        del buf
    assert tracker.by_phase["checkpoint_save"]["other"] == 4 * N
    assert tracker.best_step is None  # no training step was tracked


def test_off_records_nothing(setup):
    weight = setup[0]
    tracker = PeakTracker(CPU, "off")
    with tracker.step(True):
        (weight * 2).sum().backward()
    with tracker.region("checkpoint_save"):
        torch.ones(N)
    assert tracker.last_step is None and tracker.best_step is None
    assert tracker.by_phase == {} and tracker.current == 0


def test_a_failed_region_leaves_no_mode_behind():
    tracker = PeakTracker(CPU, "logged")
    resize = torch.UntypedStorage.resize_
    with pytest.raises(RuntimeError), tracker.region("startup"):
        raise RuntimeError("boom")
    assert torch.UntypedStorage.resize_ is resize
    before = tracker.current
    torch.ones(N)
    assert tracker.current == before  # nothing is being tracked any more


def test_module_state_is_counted_as_such():
    model = torch.nn.Linear(8, 8)
    tracker = PeakTracker(CPU, "alternate")
    tracker.watch(lambda: module_state_tensors(model))
    with tracker.step(tracked=True):
        model(torch.ones(2, 8)).sum().backward()
    peak = tracker.last_step
    assert peak["params"] == 4 * (64 + 8)
    assert tracker.totals["grads"] == 4 * (64 + 8)


def test_one_process_run_reports_its_peak(tmp_path, text_corpus, cache_dir):
    # Two micro-batches: the second one's forward and backward run beside the first one's
    # gradients (with one, the peak is early in backward, before any gradient exists).
    summary, out = run(
        tmp_path, "single", text_corpus, cache_dir, "model=gpt2-tiny", "train.grad_accum_steps=2"
    )
    (peak,) = summary["memory_peak"]
    state = summary["model_state_bytes"][0]
    assert peak["params"] == state["params"]
    assert peak["grads"] > 0 and peak["activations"] > 0
    assert peak["total"] == _parts(peak)
    assert peak["phase"] in {"forward", "backward", "optimizer_step"}
    assert summary["peak_memory_bytes"] == peak["total"]  # CPU: the tracker's total
    (by_phase,) = summary["memory_peak_by_phase"]
    assert {"startup", "forward", "backward", "optimizer_step", "checkpoint_save"} <= set(by_phase)
    # Start-up fills parameters one by one from the weight source, so its peak (while the
    # largest parameter is drawn) may fall before the last small ones exist.
    assert 0.9 * state["params"] < by_phase["startup"]["params"] <= state["params"]
    assert summary["max_peak_memory_bytes"] == max(p["total"] for p in by_phase.values())
    assert summary["process_peak_rss_bytes"] > summary["max_peak_memory_bytes"]
    rows = [m for m in read_metrics(out) if "loss" in m]
    probes = [m for m in rows if m["probe"]]  # log_every=1: every other step is tracked
    assert [m["step"] for m in probes] == [1, 3, 5]
    assert all(len(m["memory_peak"]) == 1 for m in probes)
    assert all(m["peak_memory_bytes"] == m["memory_peak"][0]["total"] for m in probes)
    assert all("memory_peak" not in m for m in rows if not m["probe"])


def test_tracking_off_run_reports_no_peak(tmp_path, text_corpus, cache_dir):
    summary, out = run(
        tmp_path, "off", text_corpus, cache_dir, "train.memory_tracking=off", "train.max_steps=2"
    )
    assert summary["memory_peak"] == [None] and summary["memory_peak_by_phase"] == [{}]
    assert summary["peak_memory_bytes"] is None
    assert all("memory_peak" not in m for m in read_metrics(out))


@pytest.mark.slow
def test_two_rank_ddp_rows_have_one_peak_per_rank(tmp_path, text_corpus, cache_dir):
    summary, out = run(
        tmp_path,
        "ddp",
        text_corpus,
        cache_dir,
        "parallelism=ddp",
        "launcher.nproc_per_node=2",
        "train.max_steps=3",
    )
    rows = [m for m in read_metrics(out) if "loss" in m and m["probe"]]
    assert rows and all(len(m["memory_peak"]) == 2 for m in rows)
    for row in rows:
        assert row["peak_memory_bytes"] == max(p["total"] for p in row["memory_peak"])
    assert len(summary["memory_peak"]) == 2
    # Replicas: the same parameter bytes on both ranks.
    assert summary["memory_peak"][0]["params"] == summary["memory_peak"][1]["params"] > 0
