"""``train.peak_tensors``: the largest tensors live at the tracked step's peak, each with its
category there and the op (and line of llm/) that made it; recording them leaves the peak
itself unchanged, and a rehearsal writes and prints them."""

from __future__ import annotations

import pytest
import torch

from llm.config import TrainConfig
from llm.errors import ConfigError
from llm.memory import PeakTracker
from llm.rehearse.rank import rehearse
from tests.helpers import compose_config, small_run_overrides

CPU = torch.device("cpu")
N = 1024


def _step(tensors: int):
    """One tracked step: a saved activation of N elements, a 64N temporary at the peak (the
    optimizer step), a weight and its gradient and momentum buffer of N each."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(N))
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    tracker = PeakTracker(CPU, "alternate", tensors)
    tracker.watch(
        lambda: {
            "params": [weight],
            "grads": [weight.grad],
            "optimizer_states": [v for s in opt.state.values() for v in s.values()],
        }
    )
    x = torch.randn(N)
    for _ in range(2):  # the second step has the momentum buffer
        with tracker.step(tracked=True):
            loss = ((weight * x) ** 2).sum()
            tracker.phase("backward")
            tracker.watch_backward(loss)
            loss.backward()
            tracker.phase("optimizer_step")
            temp = torch.ones(64 * N)
            opt.step()
            del temp
            opt.zero_grad(set_to_none=False)
    return tracker


def test_the_largest_tensors_at_the_peak_are_listed_largest_first():
    """At the optimizer step: the temporary, then the weight, its gradient, its momentum
    buffer and the input (no longer saved once backward ran: other), N elements each."""
    tracker = _step(tensors=5)
    listed = tracker.best_step_tensors
    assert [t["bytes"] for t in listed] == [64 * N * 4] + [N * 4] * 4
    top = listed[0]
    assert top["category"] == "other" and top["made_by"].startswith("aten.ones")
    assert sorted(t["category"] for t in listed[1:]) == [
        "grads", "optimizer_states", "other", "params"
    ]  # fmt: skip


def test_listing_them_leaves_the_peak_as_it_was():
    with_list, without = _step(tensors=8), _step(tensors=0)
    assert with_list.best_step == without.best_step
    assert without.best_step_tensors is None and without.live.origins is None


def test_a_negative_count_is_refused():
    with pytest.raises(ConfigError, match=r"train\.peak_tensors=-1"):
        TrainConfig(peak_tensors=-1)


def test_a_rehearsal_names_what_made_each_tensor(tmp_path, text_corpus, cache_dir, capsys):
    """gpt2-tiny, zero2 over 4 rehearsed ranks: the listed tensors add up to at most the
    peak, the largest first, and each tensor made in our code names its line of llm/."""
    overrides = small_run_overrides(
        tmp_path, text_corpus, cache_dir, "parallelism=zero2", "train.peak_tensors=12"
    )
    summary = rehearse(compose_config([*overrides, "rehearse.world_size=4"]))
    listed = list(summary["memory_peak_tensors"][0].values())
    peak = summary["memory_peak"][0]
    assert len(listed) == 12 and sum(t["bytes"] for t in listed) <= peak["total"]
    assert [t["bytes"] for t in listed] == sorted((t["bytes"] for t in listed), reverse=True)
    assert any(" at llm/" in t["made_by"] for t in listed)
    for category in {t["category"] for t in listed}:
        assert sum(t["bytes"] for t in listed if t["category"] == category) <= peak[category]
