"""The peak tracker's ``UntypedStorage.resize_`` patch (llm/memory/live.py) changes nothing
the strategies see (issue 41, item 4; docs/zero.md, "Stage 3 under asynchronous NCCL"):
torch's method runs first with the caller's arguments, its return value and exceptions
pass through, trackers that start and stop in any order leave torch's method behind (or the
wrapper another tool installed before them, which keeps seeing every resize), and
zero3 and FSDP2, which free and refill storages with it, train to the same bits with
tracking on and off."""

from __future__ import annotations

import pytest
import torch
from helpers import final_weights, run, train_losses

from llm.memory.live import LiveStorages

TORCH_RESIZE = torch.UntypedStorage.resize_


def _ledger() -> LiveStorages:
    return LiveStorages(torch.device("cpu"), on_high=lambda: None)


def _error(call) -> tuple[type, str]:
    with pytest.raises(Exception) as caught:
        call()
    return caught.type, str(caught.value)


def test_the_patch_returns_what_torch_returns_and_raises_what_torch_raises():
    storage = torch.zeros(4).untyped_storage()
    unpatched = [
        _error(lambda: storage.resize_(-1)),
        _error(lambda: storage.resize_(size=8)),  # torch's method takes no keyword
    ]
    ledger = _ledger()
    ledger.wrap_resize()
    try:
        assert torch.UntypedStorage.resize_ is not TORCH_RESIZE
        tensor = torch.zeros(4)
        ledger.see(tensor)
        grown = tensor.untyped_storage()
        assert grown.resize_(64) is grown
        assert ledger.current == 64  # and the ledger saw the new size
        assert grown.resize_(0) is grown and ledger.current == 0
        patched = [
            _error(lambda: storage.resize_(-1)),
            _error(lambda: storage.resize_(size=8)),
        ]
    finally:
        ledger.unwrap_resize()
    assert patched == unpatched
    assert torch.UntypedStorage.resize_ is TORCH_RESIZE


def test_a_wrapper_installed_before_tracking_keeps_seeing_resizes_and_comes_back(monkeypatch):
    """Another tool's resize_ wrapper (torch's MemTracker installs one when entered) is what
    the patch calls, so it keeps seeing every resize while we track, and it is what the
    last tracker to stop puts back."""
    seen = []

    def outer(storage, *args, **kwargs):
        seen.append(args)
        return TORCH_RESIZE(storage, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", outer)
    ledger = _ledger()
    tensor = torch.zeros(8)
    ledger.see(tensor)
    ledger.wrap_resize()
    try:
        tensor.untyped_storage().resize_(128)
    finally:
        ledger.unwrap_resize()
    assert seen == [(128,)] and ledger.current == 128
    assert torch.UntypedStorage.resize_ is outer


def test_trackers_stopping_in_any_order_leave_torchs_method():
    first, second = _ledger(), _ledger()
    tensor = torch.zeros(8)
    first.see(tensor)
    second.see(tensor)
    first.wrap_resize()
    second.wrap_resize()
    first.unwrap_resize()  # the first to start stops first: the second still tracks
    tensor.untyped_storage().resize_(128)
    assert (first.current, second.current) == (32, 128)
    second.unwrap_resize()
    assert torch.UntypedStorage.resize_ is TORCH_RESIZE
    tensor.untyped_storage().resize_(0)
    assert second.current == 128  # no longer told


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_tracking_leaves_losses_and_weights_bit_identical(
    tmp_path, text_corpus, cache_dir, strategy
):
    """2 gloo ranks, every step logged: tracked steps (every other one) and untracked
    runs give the same losses and final weights, bit for bit."""
    common = (
        f"parallelism={strategy}",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=2",
        "train.max_steps=4",
    )
    runs = {
        mode: run(tmp_path, mode, text_corpus, cache_dir, *common, f"train.memory_tracking={mode}")
        for mode in ("logged", "off")
    }
    tracked, untracked = runs["logged"][1], runs["off"][1]
    assert runs["logged"][0]["memory_peak"][0] is not None  # the patch was in place
    assert train_losses(tracked) == train_losses(untracked)
    weights, reference = final_weights(tracked), final_weights(untracked)
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
