"""Memory accounting, peak FLOP/s lookup, MFU and step timing."""

import pytest
import torch
from torch import nn

from llm.memory import (
    ActivationMemoryCounter,
    cuda_peak_bytes,
    model_state_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    storage_bytes,
)
from llm.train.metrics import StepTimer, lookup_peak_flops, mfu, peak_flops

CPU = torch.device("cpu")


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(10, 10)  # 400 bytes
    assert storage_bytes([base, base[0], base.t(), base.view(-1)[5:], None]) == 400
    assert storage_bytes([base, torch.zeros(3, dtype=torch.bfloat16)]) == 406
    assert storage_bytes([]) == 0


def test_storage_bytes_tied_weights_and_meta_tensors():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert storage_bytes([emb.weight, head.weight]) == 160
    with torch.device("meta"):
        a, b = torch.empty(8, 8), torch.empty(8, 8)
    # Meta tensors count what they will take; distinct meta storages stay distinct.
    assert storage_bytes([a, a[1:], b]) == 2 * 256


def test_model_state_bytes_for_linear_adamw_after_one_step():
    model = nn.Linear(32, 16)
    numel = 32 * 16 + 16
    opt = torch.optim.AdamW(model.parameters())
    assert model_state_bytes(model, opt) == {"params": 4 * numel, "grads": 0, "optimizer_states": 0}
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq in fp32, plus one fp32 0-d `step` tensor per param (2 params).
    assert model_state_bytes(model, opt) == {
        "params": 4 * numel,
        "grads": 4 * numel,
        "optimizer_states": 8 * numel + 2 * 4,
    }
    assert model_state_bytes(model)["optimizer_states"] == 0


def test_activation_counter_counts_a_matmul_chain_exactly():
    x = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 4, requires_grad=True)
    with ActivationMemoryCounter() as counter:
        h = x @ w1  # saves x (512 B) and w1 (2048 B)
        y = h @ w2  # saves h (1024 B) and w2 (512 B)
        loss = y.sum()  # saves nothing
    assert counter.bytes == 512 + 2048 + 1024 + 512
    loss.backward()  # the saved tensors still work
    torch.testing.assert_close(x.grad, torch.ones(8, 4) @ w2.T @ w1.T)


def test_activation_counter_dedups_views_and_repeats():
    x = torch.randn(64, requires_grad=True)
    with ActivationMemoryCounter() as counter:
        a = x * x  # saves x twice: one storage
        b = x[:32].sin()  # saves a view of x: the same storage
    assert counter.bytes == 256
    (a.sum() + b.sum()).backward()


def test_rss_helpers_report_plausible_sizes():
    rss, peak = process_rss_bytes(), peak_rss_bytes()
    assert 10 * 2**20 < rss <= peak < 2**40
    assert cuda_peak_bytes(CPU) is None


def test_peak_flops_table():
    assert peak_flops(CPU, torch.bfloat16) is None
    assert lookup_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert lookup_peak_flops("NVIDIA H200", "tf32") == 494.5e12
    assert lookup_peak_flops("NVIDIA H100 PCIe", torch.float16) == 756e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert lookup_peak_flops("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None
    assert lookup_peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert lookup_peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) == 165.2e12
    assert lookup_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    # Whole-name matches only: an L40S is not an L4, an unknown GPU gets no invented peak.
    assert lookup_peak_flops("NVIDIA L40S", torch.bfloat16) is None
    assert lookup_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_mfu_arithmetic():
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert mfu(1000.0, 6e9, None) is None


def test_step_timer_splits_data_wait_from_the_step_and_reads_late():
    ticks = iter([0.0, 1.0, 1.5, 2.0, 2.25, 4.0, 5.0, 5.5, 6.0, 8.0])
    timer = StepTimer(CPU, clock=lambda: next(ticks))
    with timer.step():  # starts at 0.0
        with timer.data():  # 1.0 -> 1.5
            pass
        with timer.data():  # 2.0 -> 2.25
            pass
    # ends at 4.0; a second step from 5.0 to 8.0 waits 0.5 for data
    with timer.step(), timer.data():
        pass
    first, second = timer.collect()  # both steps, read together
    assert (first.step_time_s, first.data_wait_s) == (4.0, 0.75)
    assert first.data_wait_share == pytest.approx(0.1875)
    assert (second.step_time_s, second.data_wait_s) == (3.0, 0.5)
    assert timer.collect() == []  # each step is read once
