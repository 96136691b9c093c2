"""Our Triton FlashAttention kernel against eager attention.

CPU: the kernels run in Triton's interpreter, in a subprocess (see triton_interpreter_cases.py),
in fp32; output and dQ, dK, dV must match eager (an explicit document mask where documents
are packed) within rtol 1e-4, atol 2e-5: fp32 rounding of a different summation order.
GPU: bf16 and fp16 against an fp32 reference, no worse than twice the error of SDPA's
flash kernel (the FlashAttention repository's own criterion).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter_cases import CASES, Case, make_inputs

from llm.attention import attention
from llm.attention.eager import repeat_kv
from llm.attention.triton_flash import (
    TRITON_SUPPORT,
    flash_attention_triton,
    triton_available,
    triton_interpreter_problem,
)
from llm.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
RTOL, ATOL = 1e-4, 2e-5


def masked_reference(q, k, v, *, causal: bool, doc_ids=None):
    """softmax(q k^T / sqrt(D) + mask) v in plain PyTorch, with the mask spelled out."""
    n_rep = q.size(1) // k.size(1)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    t = q.size(2)
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.expand(q.size(0), 1, t, t)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.size(-1) ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.float()  # (B, H, T, D)


def reference_grads(case: Case):
    x = make_inputs(case, poisoned=False)
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    if x["doc_ids"] is None:
        out = attention(q, k, v, causal=case.causal, backend="eager")
    else:
        out = masked_reference(q, k, v, causal=case.causal, doc_ids=x["doc_ids"])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["grad_out"])
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Our kernel's outputs and gradients for every case, computed in Triton's interpreter."""
    pytest.importorskip("triton")  # a requirement on Linux; no wheels elsewhere
    if why := triton_interpreter_problem():  # triton 3.6 (torch 2.11) with numpy 2.4
        pytest.skip(why)
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = Path(__file__).parent / "triton_interpreter_cases.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_eager(interpreted, name):
    """Every case's output and gradients; the poisoned cases check only what the NaNs must not
    reach, against the reference without NaNs, so a skipped block that is read fails them."""
    case = CASES[name]
    ours, ref = interpreted["cases"][name], reference_grads(case)
    checked = case.checked or [(key, 0, case.seq_len) for key in ("out", "dq", "dk", "dv")]
    for key, start, end in checked:
        assert ours[key].shape == ref[key].shape, key
        got, want = ours[key][:, :, start:end], ref[key][:, :, start:end]
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=key)


def test_documents_do_not_see_each_other(interpreted):
    """Changing one document's values leaves the other documents' outputs unchanged: a
    mask that leaked across a boundary fails this even if the reference had the same bug."""
    case = CASES["docs_causal_T100_D32"]
    x = make_inputs(case, poisoned=False)
    first = x["doc_ids"][0] == x["doc_ids"][0, 0]
    # The reference on row 0 with the first document's keys and values replaced.
    k, v = x["k"].clone(), x["v"].clone()
    k[0, :, first], v[0, :, first] = 7.0, -7.0
    changed = masked_reference(x["q"], k, v, causal=True, doc_ids=x["doc_ids"])
    out = interpreted["cases"]["docs_causal_T100_D32"]["out"]
    torch.testing.assert_close(out[0, :, ~first], changed[0, :, ~first], rtol=RTOL, atol=ATOL)
    assert not torch.allclose(out[0, :, first], changed[0, :, first], atol=0.1)


def test_autotuned_configs_are_recorded_per_kernel_and_key(interpreted):
    """The recording helper reads each kernel's choice per tuning key back from triton's
    autotuners: under the interpreter, the one configuration of INTERPRETER_BLOCKS."""
    from llm.attention.triton_configs import INTERPRETER_BLOCKS

    rows = interpreted["autotuned"]
    kernels = {"forward": "fwd", "backward_dkdv": "dkdv", "backward_dq": "dq"}
    keys = {(c.seq_len, c.head_dim, c.causal, c.docs is not None) for c in CASES.values()}
    for kernel, short in kernels.items():
        mine = [r for r in rows if r["kernel"] == kernel]
        assert {(r["seq_len"], r["head_dim"], r["causal"], r["documents"]) for r in mine} == keys
        assert {(r["block_m"], r["block_n"]) for r in mine} == {INTERPRETER_BLOCKS[short]}
        assert {r["dtype"] for r in mine} == {"float32"}


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ConfigError, match="CUDA tensors"):
        flash_attention_triton(q, q, q, causal=True)


def test_interpreter_before_triton_3_7_is_refused_in_one_line(monkeypatch):
    """torch 2.11 pins triton 3.6, whose interpreter cannot index with numpy 2.4's arrays:
    the interpreted kernel is refused in one line naming the versions and the fix."""
    triton = pytest.importorskip("triton")
    np = pytest.importorskip("numpy")
    try:
        int(np.ones(1))
        pytest.skip(f"numpy {np.__version__} still converts 1-element arrays")
    except TypeError:
        pass
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert triton_interpreter_problem() is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ConfigError, match=r"triton 3\.7\+.*torch 2\.12\+") as err:
        flash_attention_triton(q, q, q, causal=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        ((1, 2, 8, 48), {}, "head dims"),
        ((1, 2, 8, 32), {"dropout_p": 0.1}, "no dropout"),
        ((1, 2, 8, 32), {"doc_ids": torch.zeros(1, 9, dtype=torch.long)}, "doc_ids"),
    ],
)
def test_unsupported_inputs_are_refused_in_one_line(shape, kwargs, match):
    q = torch.randn(*shape)
    with pytest.raises(ConfigError, match=match) as err:
        flash_attention_triton(q, q, q, causal=True, **kwargs)
    assert "\n" not in str(err.value)


def test_mismatched_heads_are_refused():
    q, kv = torch.randn(1, 3, 8, 32), torch.randn(1, 2, 8, 32)
    with pytest.raises(ConfigError, match="divide"):
        flash_attention_triton(q, kv, kv, causal=False)


def test_without_triton_the_repo_imports_and_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert "pip install" in triton_available()
    q = torch.randn(1, 2, 8, 32)
    with pytest.raises(ConfigError, match=r"triton==3\.9\.0"):
        flash_attention_triton(q, q, q, causal=True)


def test_availability_names_the_missing_gpu():
    reason = triton_available()
    if torch.cuda.is_available():
        ok = torch.cuda.get_device_capability() >= TRITON_SUPPORT.min_compute_capability
        assert (reason is None) == ok, reason
    else:
        assert "CUDA" in reason and "attention=sdpa" in reason
