"""Every attention backend against the eager reference, forward and backward."""

import pytest
import torch

from llm.attention import BACKENDS, AttentionKernel, attention, get_kernel, register_backend
from llm.attention.eager import SUPPORT, eager
from llm.errors import ConfigError

B, T, D = 2, 16, 8


def _qkv(h: int, h_kv: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, h, T, D), (B, h_kv, T, D), (B, h_kv, T, D)]
    return [torch.randn(s, generator=g, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sdpa_matches_eager_forward_and_grads(heads, causal):
    results = {}
    for backend in ("eager", "sdpa"):
        q, k, v = _qkv(*heads)
        out = attention(q, k, v, causal=causal, backend=backend)
        assert out.shape == (B, heads[0], T, D)
        out.pow(2).sum().backward()
        results[backend] = (out, q.grad, k.grad, v.grad)
    for ref, got in zip(results["eager"], results["sdpa"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_gqa_groups_consecutive_query_heads():
    # Query head h reads kv head h // (H / Hkv), as HF's repeat_kv: checkpoints depend on it.
    q, k, v = _qkv(4, 2)
    grouped = attention(q, k, v, backend="eager")
    full = attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), backend="eager")
    torch.testing.assert_close(grouped, full, atol=0, rtol=0)


def test_causal_ignores_the_future():
    q, k, v = _qkv(2, 2)
    out = attention(q, k, v, backend="eager")
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, -1], v2[:, :, -1] = 100.0, -100.0
    out2 = attention(q, k2, v2, backend="eager")
    torch.testing.assert_close(out2[:, :, :-1], out[:, :, :-1], atol=0, rtol=0)


def test_unknown_backend_names_the_choices():
    with pytest.raises(
        ConfigError,
        match=r"attention.backend='x' is unknown; choose one of eager, sdpa, flash_attn, flex, triton, xformers",
    ):
        get_kernel("x")
    q, k, v = _qkv(2, 2)
    with pytest.raises(ConfigError, match="unknown"):
        attention(q, k, v, backend="flash_nope")


def test_mismatched_heads_are_refused():
    q, k, v = _qkv(4, 3)
    with pytest.raises(ConfigError, match="must divide"):
        attention(q, k, v)


def test_registered_backend_is_dispatched_to():
    calls = []

    def spy(q, k, v, *, causal, dropout_p, scale, docs):
        calls.append((causal, dropout_p, scale, docs))
        return eager(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale, docs=docs)

    register_backend("spy", {"auto": AttentionKernel(spy, lambda: SUPPORT)})
    try:
        q, k, v = _qkv(2, 1)
        attention(q, k, v, backend="spy", causal=False)
    finally:
        del BACKENDS["spy"]
    assert calls == [(False, 0.0, D**-0.5, None)]
