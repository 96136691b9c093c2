"""The MoE experts on CUDA (`make test-gpu`): `kernel=auto` takes the grouped matmul on
compute capability 9.0+ in bf16, and it equals the loop over experts."""

from __future__ import annotations

import pytest
import torch

from llm.models.moe import Experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_auto_takes_the_grouped_matmul_on_hopper_in_bf16():
    experts = Experts(8, 256, 512, "auto").cuda()
    x = torch.zeros(4, 256, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert (not experts.reads_counts(x)) == hopper
    assert experts.reads_counts(x.float())


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch's grouped matmul needs compute capability 9.0",
)
def test_grouped_equals_the_loop_in_bf16_forward_and_backward():
    torch.manual_seed(0)
    counts = torch.tensor([0, 37, 5, 120, 1, 64, 0, 29], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    out, grads = {}, {}
    weights = [torch.randn(8, 512, 256) * 0.05, torch.randn(8, 512, 256) * 0.05,
               torch.randn(8, 256, 512) * 0.05]  # fmt: skip
    for kernel in ("loop", "grouped"):
        experts = Experts(8, 256, 512, kernel).cuda().to(torch.bfloat16)
        with torch.no_grad():
            for p, w in zip((experts.w1, experts.w3, experts.w2), weights, strict=True):
                p.copy_(w)
        xi = x.clone().requires_grad_(True)
        y = experts(xi, counts)
        y.float().square().sum().backward()
        out[kernel], grads[kernel] = y.float(), [xi.grad.float(), experts.w1.grad.float()]
    torch.testing.assert_close(out["grouped"], out["loop"], rtol=2e-2, atol=2e-2)
    for a, b in zip(grads["grouped"], grads["loop"], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
