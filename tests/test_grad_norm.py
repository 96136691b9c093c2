"""The gradient norm every strategy logs and clips by (llm/parallel/step.py): torch's
get_total_norm over pieces of NORM_PIECE elements, summed in fp64. torch's fp32 norm of one
large CPU tensor reads low, so a rank holding a whole gradient (single, ddp) and ranks holding
shards (ZeRO, FSDP) would otherwise disagree by up to 2.7e-3 relative."""

from __future__ import annotations

import torch

from llm.parallel.step import global_grad_norm


def _reference(tensors) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5


def test_a_large_gradient_reads_its_fp64_norm():
    g = torch.randn(50257 * 768, generator=torch.Generator().manual_seed(0)) * 1e-3
    whole_fp32 = float(g.norm())
    ours = float(global_grad_norm([g], torch.device("cpu"), 1))
    ref = _reference([g])
    assert abs(whole_fp32 / ref - 1) > 1e-3  # the error this guards against is real
    assert abs(ours / ref - 1) < 1e-6


def test_a_whole_tensor_and_its_shards_read_the_same_norm():
    g = torch.randn(4_000_037, generator=torch.Generator().manual_seed(1))
    shards = list(g.tensor_split(3))  # uneven pieces, as ZeRO's buckets cut them
    whole = float(global_grad_norm([g], torch.device("cpu"), 1))
    sharded = float(global_grad_norm(shards, torch.device("cpu"), 1))
    assert abs(whole / sharded - 1) < 1e-7
    assert abs(whole / _reference([g]) - 1) < 1e-6


def test_non_finite_and_empty_gradients():
    assert float(global_grad_norm([], torch.device("cpu"), 1)) == 0.0
    bad = torch.ones(10)
    bad[3] = float("inf")
    assert not torch.isfinite(global_grad_norm([bad], torch.device("cpu"), 1))
    nan = torch.ones(10)
    nan[0] = float("nan")
    assert not torch.isfinite(global_grad_norm([nan, torch.ones(3)], torch.device("cpu"), 1))
