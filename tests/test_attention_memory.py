"""What attention saves for backward: eager keeps O(T^2) per head, flash kernels O(T); and the
peak tracker shows attention's share of the activations. On CPU the measured kernels are
eager, sdpa's math and sdpa's flash (FlexAttention has no CPU backward, so saves nothing
there; flash_attn and triton run on GPUs)."""

from __future__ import annotations

import pytest
import torch

from llm.attention.measure import saved_bytes
from llm.memory import ActivationMemoryCounter, PeakTracker, module_state_tensors
from llm.models import MODEL_SHAPES, build_model, materialize

SHAPE = (1, 2, 2, 256, 8)  # B, H, Hkv, T, D: T >> D, so the T^2 terms dominate eager's bytes


def _doubled(shape):
    b, h, h_kv, t, d = shape
    return (b, h, h_kv, 2 * t, d)


@pytest.mark.parametrize(
    ("backend", "kernel", "low", "high"),
    [
        ("eager", "auto", 3.8, 4.0),  # fp32 scores and probabilities, (B, H, T, T) each
        ("sdpa", "math", 3.8, 4.0),  # the math kernel materialises them too
        ("sdpa", "flash", 1.99, 2.01),  # q, k, v, output and log-sum-exp: all O(T)
    ],
)
def test_doubling_t_scales_saved_bytes_by_t_squared_or_t(backend, kernel, low, high):
    one = saved_bytes(backend, kernel, shape=SHAPE)
    two = saved_bytes(backend, kernel, shape=_doubled(SHAPE))
    assert one > 0 and low <= two / one <= high, (one, two)


def test_flash_saves_output_and_logsumexp_beside_its_inputs():
    b, h, h_kv, t, d = SHAPE
    inputs = 4 * (b * h * t * d + 2 * b * h_kv * t * d)  # q, k, v in fp32
    extra = saved_bytes("sdpa", "flash", shape=SHAPE) - inputs
    assert extra == 4 * b * h * t * (d + 1)  # the output (B, H, T, D) and lse (B, H, T)


@pytest.mark.parametrize(("backend", "kernel"), [("eager", "auto"), ("sdpa", "flash")])
def test_peak_tracker_shows_what_attention_saved(backend, kernel):
    torch.manual_seed(0)
    model = materialize(build_model(MODEL_SHAPES["llama-tiny"], backend, kernel), "cpu", 0)
    ids = torch.randint(0, 4096, (2, 64))
    with ActivationMemoryCounter() as counter:
        model(ids).float().sum()
    tracker = PeakTracker(torch.device("cpu"), "alternate")
    tracker.watch(lambda: {"params": module_state_tensors(model)["params"]})
    with tracker.step(tracked=True):
        loss = model(ids).float().sum()
        tracker.phase("backward")
        loss.backward()
    forward = tracker.by_phase["forward"]
    # At the forward's peak every layer's saved attention tensors are alive: the same
    # storages the counter saw, counted once each; attention's share is part of activations.
    assert forward["activations_attention"] == counter.by_label["attention"] > 0
    assert forward["activations_attention"] <= forward["activations"]
    assert tracker.by_phase["backward"]["activations_attention"] <= counter.by_label["attention"]
