"""Every attention backend on the heads one tensor-parallel rank computes, against the same
heads of the unsplit model, in one process.

The rank is rank 0 of conftest's ``fake_tp_mesh`` (tp=2, collectives return without
communicating). Without sequence parallel, nothing between a block's input and the input of
``wo`` communicates: the column-parallel q/k/v projections and the attention core are
local. So the core's output on this rank (``wo``'s input) is real, and must equal the
first half of the unsplit model's, whose heads 0 .. n_heads/2 - 1 this rank holds, with
the kv heads those query heads use: split (llama-tiny, 2 kv heads -> 1 per rank) or
replicated (multi-query, the one kv head on both ranks). fp32, 1e-5.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from llm.attention import flex as flex_module
from llm.models import build_model, model_args
from llm.models.weights import InitSource, materialize_from
from llm.parallel.tensor_parallel import apply_tensor_parallel
from tests.flash_attn_stand_in import stand_in
from tests.xformers_stand_in import install as install_xformers

CPU = torch.device("cpu")
B, T = 2, 16


def _wo_input(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of block 0's ``wo``: the attention core's output, (B, T, local heads x D)."""
    seen = []
    attention = model.layers[0].attention
    handle = attention.wo.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        attention(x, None, None)  # (x, docs, positions), as the block calls it
    handle.remove()
    out = seen[0]
    return out.to_local() if hasattr(out, "to_local") else out


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash_attn", "flex", "xformers"])
@pytest.mark.parametrize(
    ("family", "shape"),
    [("gpt2-tiny", {}), ("llama-tiny", {}), ("llama-tiny", {"n_kv_heads": 1})],
    ids=["gpt2", "llama-gqa-split", "llama-mqa-replicated"],
)
def test_backend_on_local_heads_equals_the_unsplit_heads(
    fake_tp_mesh, monkeypatch, backend, family, shape
):
    # The packages' stand-ins (flash-attn, xformers) compute with eager; flex runs uncompiled.
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in([]))
    install_xformers(monkeypatch)
    monkeypatch.setattr(flex_module, "compiled_flex", lambda: flex_attention)
    args = model_args(family, vocab_size=258, dropout=0.0, **shape)
    whole = materialize_from(build_model(args, backend), InitSource(args, 0), CPU).eval()
    split = apply_tensor_parallel(build_model(args, backend), fake_tp_mesh, False)
    split = materialize_from(split, InitSource(args, 0), CPU).eval()
    x = torch.randn(B, T, args.d_model, generator=torch.Generator().manual_seed(0))
    expected = _wo_input(whole, x)
    got = _wo_input(split, x)
    half = args.n_heads // 2 * args.head_dim
    assert got.shape == (B, T, half)
    torch.testing.assert_close(got, expected[..., :half], atol=1e-5, rtol=1e-5)
