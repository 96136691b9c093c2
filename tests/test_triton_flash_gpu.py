"""Our compiled Triton kernel on a GPU (`make test-gpu`; CI has none and deselects these).

The criterion of the FlashAttention repository's tests: in 16-bit, against an fp32
reference, our largest error in the output and in each gradient is at most twice that of
PyTorch's own fused kernel on the same 16-bit inputs (SDPA's flash kernel; its
memory-efficient kernel where a document mask is needed, since flash takes no mask).
Plus 1e-5, so that an exact reference value does not demand exactness of us.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_flash import masked_reference
from torch.nn.attention import SDPBackend, sdpa_kernel

from llm.attention.eager import repeat_kv
from llm.attention.triton_flash import flash_attention_triton, triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(triton_available() is not None, reason=str(triton_available())),
]

FACTOR, FLOOR = 2.0, 1e-5
SHAPES = [  # (batch, heads, kv_heads, seq_len, head_dim)
    (2, 8, 8, 1000, 64),
    (1, 8, 2, 2048, 128),
    (2, 4, 1, 333, 32),
]


def _inputs(shape, dtype, docs: bool, seed: int = 0):
    b, h, hk, t, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, t, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hk, t, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hk, t, d, device="cuda", generator=g).to(dtype)
    do = torch.randn(b, h, t, d, device="cuda", generator=g).to(dtype)
    doc_ids = None
    if docs:  # uneven documents, different per row
        cuts = torch.tensor([t // 7, t // 2 + 5, t - 3], device="cuda")
        doc_ids = torch.stack(
            [torch.bucketize(torch.arange(t, device="cuda"), cuts + r) for r in range(b)]
        )
    return q, k, v, do, doc_ids


def _out_and_grads(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _sdpa(causal: bool, doc_ids):
    def run(q, k, v):
        n_rep = q.size(1) // k.size(1)
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if doc_ids is None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        t = q.size(2)
        mask = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
        if causal:
            mask = mask & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


# Every shape, causal and not, with and without documents, in bf16; fp16 on one shape. Each
# (head dim, causal, documents, dtype) compiles and autotunes every kernel configuration once.
CASES = [
    *(
        (shape, causal, docs, torch.bfloat16)
        for shape in SHAPES
        for causal in (False, True)
        for docs in (False, True)
    ),
    (SHAPES[1], True, False, torch.float16),
    (SHAPES[0], False, True, torch.float16),
]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls(monkeypatch):
    """The fp32 reference must not run its matmuls in TF32, whatever earlier tests set."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize(("shape", "causal", "docs", "dtype"), CASES)
def test_16bit_error_is_no_worse_than_sdpa(shape, causal, docs, dtype):
    q, k, v, do, doc_ids = _inputs(shape, dtype, docs)
    ref = _out_and_grads(
        lambda q, k, v: masked_reference(q, k, v, causal=causal, doc_ids=doc_ids),
        *(x.float() for x in (q, k, v, do)),
    )
    ours = _out_and_grads(
        lambda q, k, v: flash_attention_triton(q, k, v, causal=causal, doc_ids=doc_ids), q, k, v, do
    )
    theirs = _out_and_grads(_sdpa(causal, doc_ids), q, k, v, do)
    for name, r, o, s in zip(("out", "dq", "dk", "dv"), ref, ours, theirs, strict=True):
        assert o.dtype == dtype and o.shape == r.shape, name
        our_err = (o.float() - r).abs().max().item()
        sdpa_err = (s.float() - r).abs().max().item()
        assert our_err <= FACTOR * sdpa_err + FLOOR, (
            f"{name}: ours {our_err:.2e}, sdpa {sdpa_err:.2e}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_matches_the_reference(causal):
    """fp32 runs with exact (not TF32) products: errors stay at fp32 rounding."""
    q, k, v, do, doc_ids = _inputs((2, 4, 2, 777, 64), torch.float32, docs=True)
    ref = _out_and_grads(
        lambda q, k, v: masked_reference(q, k, v, causal=causal, doc_ids=doc_ids), q, k, v, do
    )
    ours = _out_and_grads(
        lambda q, k, v: flash_attention_triton(q, k, v, causal=causal, doc_ids=doc_ids), q, k, v, do
    )
    for name, r, o in zip(("out", "dq", "dk", "dv"), ref, ours, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4, msg=name)
