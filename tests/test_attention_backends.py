"""The backends beside eager: sdpa's kernels, the flash-attn adapter (against a stand-in module
with the package's signatures that computes with eager), FlexAttention, the Triton adapter
(against a stand-in of llm/attention/triton_flash.py), each checked against eager in fp32,
with and without document masking. Tolerance: 1e-5 absolute and relative (fp32 kernels that
sum in another order)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from llm.attention import Documents, attention, check_kernel
from llm.attention import flex as flex_module
from llm.attention.eager import eager
from llm.errors import ConfigError
from tests.flash_attn_stand_in import stand_in

B, T, D = 2, 16, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
# Documents of lengths 5, 7, 4 in row 0, one document in row 1.
DOC_IDS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * T])


def _qkv(h: int, h_kv: int, grad: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(B, h, T, D), (B, h_kv, T, D), (B, h_kv, T, D)]
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


def _run(grad: bool = True, heads=(4, 2), **kw) -> list[torch.Tensor]:
    """The output and, with grad, the gradients of q, k, v."""
    q, k, v = _qkv(*heads, grad=grad)
    out = attention(q, k, v, **kw)
    if not grad:
        return [out]
    out.pow(2).sum().backward()
    return [out, q.grad, k.grad, v.grad]


def _assert_matches_eager(grad: bool = True, heads=(4, 2), **kw) -> None:
    ref_kw = {k: v for k, v in kw.items() if k in ("causal", "docs", "scale")}
    ref = _run(grad, heads, backend="eager", **ref_kw)
    for got, want in zip(_run(grad, heads, **kw), ref, strict=True):
        torch.testing.assert_close(got, want, **TOL)


CASES = [
    pytest.param(True, None, id="causal"),
    pytest.param(False, None, id="full"),
    pytest.param(True, DOC_IDS, id="causal-docs"),
    pytest.param(False, DOC_IDS, id="full-docs"),
]


# ---- sdpa's kernels on CPU ------------------------------------------------------------
@pytest.mark.parametrize(("causal", "doc_ids"), CASES)
@pytest.mark.parametrize("kernel", ["auto", "math", "flash"])
def test_sdpa_kernels_on_cpu_match_eager(kernel, causal, doc_ids):
    docs = None if doc_ids is None else Documents(doc_ids)
    _assert_matches_eager(backend="sdpa", kernel=kernel, causal=causal, docs=docs, scale=0.3)


@pytest.mark.parametrize("kernel", ["efficient", "cudnn"])
def test_cuda_only_sdpa_kernels_are_refused_on_cpu(kernel):
    with pytest.raises(ConfigError, match=f"sdpa_kernel={kernel} does not run on cpu"):
        check_kernel("sdpa", kernel, **_setting())
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match=f"attention.sdpa_kernel={kernel} cannot run"):
        attention(q, k, v, backend="sdpa", kernel=kernel)


def test_cpu_flash_kernel_refuses_dropout_in_one_line():
    with pytest.raises(ConfigError, match="sdpa_kernel=flash on cpu has no attention dropout"):
        check_kernel("sdpa", "flash", **_setting(dropout=True))
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match=r"sdpa_kernel=flash cannot run .* dropout") as e:
        attention(q, k, v, backend="sdpa", kernel="flash", dropout_p=0.1)
    assert "\n" not in str(e.value)


def _setting(**over) -> dict:
    s = dict(
        device="cpu",
        dtype=torch.float32,
        head_dim=D,
        gqa=True,
        dropout=False,
        document_mask=False,
        training=True,
    )
    return {**s, **over}


# ---- the flash-attn package, through a stand-in ---------------------------------------
@pytest.mark.parametrize(("causal", "doc_ids"), CASES)
def test_flash_attn_adapter_matches_eager(monkeypatch, causal, doc_ids):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in(calls))
    docs = None if doc_ids is None else Documents(doc_ids)
    _assert_matches_eager(backend="flash_attn", causal=causal, docs=docs, scale=0.3)
    # (B, T, H, D) with K/V keeping their 2 heads (native GQA), or (B*T, H, D) by documents.
    if docs is None:
        assert calls[0] == ("dense", (B, T, 4, D), (B, T, 2, D), 0.0, 0.3, causal)
    else:
        assert calls[0] == ("varlen", (B * T, 4, D), (B * T, 2, D), [0, 5, 12, 16, 32], 16, causal)


def test_flash_attn_adapter_passes_dropout(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in(calls))
    q, k, v = _qkv(4, 4)
    attention(q, k, v, backend="flash_attn", dropout_p=0.25)
    assert calls[0][3] == 0.25 and calls[0][4] == D**-0.5


def test_missing_flash_attn_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as if not installed
    with pytest.raises(
        ConfigError, match=r"needs the flash-attn package .*pip install -e \.\[flash\]"
    ):
        check_kernel("flash_attn", **_setting(device="cuda", dtype=torch.bfloat16))
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match=r"pip install -e \.\[flash\]"):
        attention(q, k, v, backend="flash_attn")


# ---- FlexAttention: evaluation on CPU -------------------------------------------------
@pytest.mark.parametrize(("causal", "doc_ids"), [CASES[1], CASES[2]])
def test_flex_evaluates_like_eager_on_cpu(monkeypatch, causal, doc_ids):
    # torch's uncompiled flex_attention runs the same BlockMask and score code unfused; the
    # compiled kernel is checked by the slow test below (compiling costs ~15 s per shape).
    monkeypatch.setattr(flex_module, "compiled_flex", lambda: flex_attention)
    docs = None if doc_ids is None else Documents(doc_ids)
    with torch.no_grad():
        _assert_matches_eager(grad=False, backend="flex", causal=causal, docs=docs, scale=0.3)


@pytest.mark.slow
def test_compiled_flex_evaluates_like_eager_on_cpu():
    with torch.no_grad():
        _assert_matches_eager(grad=False, backend="flex", docs=Documents(DOC_IDS))


def test_flex_training_on_cpu_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="attention=flex on cpu has no backward"):
        check_kernel("flex", **_setting())
    check_kernel("flex", **_setting(training=False))  # evaluation is allowed
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match="attention=flex has no backward on CPU"):
        attention(q, k, v, backend="flex")


# ---- our Triton kernel's adapter, through a stand-in of its module --------------------
def test_triton_adapter_hands_the_kernel_doc_ids_and_reads_its_support(monkeypatch):
    calls = []

    def flash_attention_triton(q, k, v, *, causal, scale=None, doc_ids=None, dropout_p=0.0):
        calls.append((q.shape, k.shape, causal, scale, doc_ids, dropout_p))
        docs = None if doc_ids is None else Documents(doc_ids)
        return eager(q, k, v, causal=causal, dropout_p=dropout_p, scale=scale, docs=docs)

    stub = types.ModuleType("llm.attention.triton_flash")
    stub.flash_attention_triton = flash_attention_triton
    stub.TRITON_SUPPORT = types.SimpleNamespace(  # the module's declaration, its field names
        devices=("cpu",),
        dtypes=(torch.float32,),
        head_dims=(32, 64, 128),
        gqa=True,
        dropout=False,
        document_masking=True,
    )
    stub.triton_available = lambda: None
    monkeypatch.setitem(sys.modules, "llm.attention.triton_flash", stub)
    docs = Documents(DOC_IDS)
    _assert_matches_eager(backend="triton", docs=docs, causal=True)
    assert calls[0][:4] == ((B, 4, T, D), (B, 2, T, D), True, D**-0.5)
    assert calls[0][4] is DOC_IDS and calls[0][5] == 0.0
    with pytest.raises(ConfigError, match="takes head dims 32, 64, 128, not 8"):
        check_kernel("triton", **_setting())
    check_kernel("triton", **_setting(head_dim=64, document_mask=True))
    with pytest.raises(ConfigError, match="attention=triton on cpu has no attention dropout"):
        check_kernel("triton", **_setting(head_dim=64, dropout=True))
    stub.triton_available = lambda: "attention=triton needs a CUDA GPU; use attention=sdpa"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        check_kernel("triton", **_setting(head_dim=64))
