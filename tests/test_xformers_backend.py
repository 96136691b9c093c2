"""attention=xformers: the adapter against a stand-in of the package (tests/xformers_stand_in.py:
xFormers' signatures and input checks, computing with eager) in fp32, causal and not, MHA,
GQA and MQA, with and without document masking, outputs and gradients within 1e-5 of eager;
what it declares it supports; its one-line refusal where the package is missing, from
check_kernel up to train.py; what it saves for backward against the activation formula."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from llm.attention import Documents, attention, check_kernel, xformers_backend
from llm.attention.eager import eager
from llm.attention.support import package_missing
from llm.errors import ConfigError
from llm.estimate import layer_terms
from llm.memory import ActivationMemoryCounter
from llm.models import Block, model_args
from llm.precision import resolve_precision
from tests.xformers_stand_in import install

REPO = Path(__file__).resolve().parent.parent

B, T, D = 2, 16, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
# Documents of lengths 5, 7, 4 in row 0, one document in row 1.
DOC_IDS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * T])
HEADS = [pytest.param((4, 4), id="mha"), pytest.param((4, 2), id="gqa"), pytest.param((4, 1), id="mqa")]  # fmt: skip
CASES = [
    pytest.param(True, None, id="causal"),
    pytest.param(False, None, id="full"),
    pytest.param(True, DOC_IDS, id="causal-docs"),
    pytest.param(False, DOC_IDS, id="full-docs"),
]


def _qkv(h: int, h_kv: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(B, h, T, D), (B, h_kv, T, D), (B, h_kv, T, D)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _run(heads, **kw) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v."""
    q, k, v = _qkv(*heads)
    out = attention(q, k, v, **kw)
    out.pow(2).sum().backward()
    return [out, q.grad, k.grad, v.grad]


def _setting(**over) -> dict:
    s = dict(
        device="cuda",
        dtype=torch.bfloat16,
        head_dim=64,
        gqa=True,
        dropout=True,
        document_mask=True,
        training=True,
    )
    return {**s, **over}


@pytest.mark.parametrize(("causal", "doc_ids"), CASES)
@pytest.mark.parametrize("heads", HEADS)
def test_adapter_matches_eager(monkeypatch, heads, causal, doc_ids):
    calls = install(monkeypatch)
    docs = None if doc_ids is None else Documents(doc_ids)
    want = _run(heads, backend="eager", causal=causal, docs=docs, scale=0.3)
    got = _run(heads, backend="xformers", causal=causal, docs=docs, scale=0.3)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=name)
    # BMHK with K/V repeated to the 4 query heads, or one row of B*T tokens cut by documents.
    if docs is None:
        kind = "causal" if causal else "full"
        assert calls == [(kind, (B, T, 4, D), (B, T, 4, D), 0.0, 0.3, None)]
    else:
        kind = "block_causal" if causal else "block"
        shape = (1, B * T, 4, D)
        assert calls == [(kind, shape, shape, 0.0, 0.3, [0, 5, 12, 16, 32])]


def test_adapter_passes_dropout_and_the_default_scale(monkeypatch):
    calls = install(monkeypatch)
    q, k, v = _qkv(4, 2)
    attention(q, k, v, backend="xformers", dropout_p=0.25)
    assert calls[0][3] == 0.25 and calls[0][4] == D**-0.5


def test_the_document_mask_is_built_once_per_forward(monkeypatch):
    install(monkeypatch)
    docs = Documents(DOC_IDS)
    mask = docs.xformers_mask(causal=True)
    assert docs.xformers_mask(causal=True) is mask  # shared by every layer
    assert type(mask).__name__ == "BlockDiagonalCausalMask"
    assert mask.q_seqinfo.seqstart_py == [0, 5, 12, 16, 32]
    assert type(docs.xformers_mask(causal=False)).__name__ == "BlockDiagonalMask"


def test_the_stand_in_catches_a_wrong_layout_or_unrepeated_heads(monkeypatch):
    # What a wrong adapter would hand the package: our (B, H, T, D) untransposed gives
    # another result; K/V with fewer heads are refused, as xFormers refuses them.
    install(monkeypatch)
    xops = importlib.import_module("xformers.ops")
    q, k, v = (x.detach() for x in _qkv(4, 4))
    untransposed = xops.memory_efficient_attention(q, k, v, attn_bias=xops.LowerTriangularMask())
    want = eager(q, k, v, causal=True, dropout_p=0.0, scale=D**-0.5, docs=None)
    assert not torch.allclose(untransposed, want, **TOL)
    q, k, v = (x.detach().transpose(1, 2) for x in _qkv(4, 2))
    with pytest.raises(ValueError, match="Incompatible shapes"):
        xops.memory_efficient_attention(q, k, v)


def test_what_it_supports(monkeypatch):
    install(monkeypatch)
    check_kernel("xformers", **_setting())
    check_kernel("xformers", **_setting(dtype=torch.float32, head_dim=256))
    with pytest.raises(ConfigError, match="attention=xformers does not run on cpu"):
        check_kernel("xformers", **_setting(device="cpu"))
    with pytest.raises(ConfigError, match=r"takes head dims 1\.\.256 in multiples of 8, not 12"):
        check_kernel("xformers", **_setting(head_dim=12))
    with pytest.raises(ConfigError, match="not 512"):
        check_kernel("xformers", **_setting(head_dim=512))


def test_missing_package_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)  # import fails as if not installed
    why = xformers_backend.unavailable()
    assert why is not None and "\n" not in why
    assert why.startswith("attention=xformers needs the xformers package (")
    with pytest.raises(ConfigError, match=r"needs the xformers package .*pip install xformers"):
        check_kernel("xformers", **_setting())
    q, k, v = _qkv(4, 2)
    with pytest.raises(ConfigError, match="pip install xformers"):
        attention(q, k, v, backend="xformers")
    # A build for another torch can fail on import with a long message: still one line.
    assert "\n" not in package_missing(
        "xformers", "xformers", RuntimeError("undefined symbol\nat line 2"), ""
    )


@pytest.mark.skipif(
    importlib.util.find_spec("xformers") is not None, reason="xformers is installed here"
)
def test_train_py_refuses_it_in_one_line_before_any_work(tmp_path):
    cmd = [sys.executable, str(REPO / "train.py"), "attention=xformers"]
    cmd.append(f"hydra.run.dir={tmp_path / 'x'}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: attention=xformers needs the xformers package (")
    assert "pip install xformers" in lines[-1]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


@pytest.mark.parametrize("family", ["gpt2-tiny", "llama-tiny"])  # MHA; GQA (4 / 2 heads)
def test_saved_bytes_equal_the_formula(monkeypatch, family):
    # The stand-in saves what xFormers saves (q, k, v, out, log-sum-exp); the adapter adds
    # K/V copies repeated to the query heads under GQA, and no other copy.
    install(monkeypatch)
    args = model_args(family, dropout=0.0)
    policy = resolve_precision("fp32", torch.device("cpu"))
    block = Block(args, "xformers", "auto").train()
    counter = ActivationMemoryCounter()
    counter._seen.update(StorageWeakRef(p.untyped_storage()) for p in block.parameters())
    x = torch.randn(B, T, args.d_model, requires_grad=True)
    with counter:
        block(x).sum().backward()
    terms = layer_terms(args, B, T, policy, backend="xformers")
    assert counter.bytes == sum(terms.values())
    assert terms["core.k"] == terms["core.q"]  # repeated to every query head


def test_formula_pads_the_cutlass_logsumexp_and_counts_repeated_kv():
    args = model_args("llama-tiny")  # 4 query heads, 2 kv heads
    for precision, rows in (("bf16_pure", 100), ("fp32", 128)):  # flash | CUTLASS: x32 rows
        policy = resolve_precision(precision, torch.device("cpu"))
        xf = layer_terms(args, 1, 100, policy, backend="xformers", device="cuda")
        fa = layer_terms(args, 1, 100, policy, backend="flash_attn", device="cuda")
        assert xf["core.logsumexp"] == args.n_heads * rows * 4
        assert xf["core.k"] == 2 * fa["core.k"] and xf["core.v"] == 2 * fa["core.v"]
