"""A stand-in for the flash-attn package (which builds only against CUDA): a module named
flash_attn with flash-attn 2's two entry points and their signatures, which checks the
layouts our adapter hands it (B, T, H, D, or B*T tokens cut by cu_seqlens), records each
call, and computes with our eager backend. Tests put it in sys.modules."""

from __future__ import annotations

import itertools
import types

import torch

from llm.attention.eager import eager


def stand_in(calls: list) -> types.ModuleType:
    """A module named flash_attn with flash-attn 2's two entry points that checks the
    layouts our adapter hands it and computes with eager."""

    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
    ):  # fmt: skip
        calls.append(("dense", q.shape, k.shape, dropout_p, softmax_scale, causal))
        out = eager(
            *(x.transpose(1, 2) for x in (q, k, v)),  # (B, T, H, D) -> (B, H, T, D)
            causal=causal, dropout_p=dropout_p, scale=softmax_scale, docs=None,
        )  # fmt: skip
        return out.transpose(1, 2)

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert isinstance(max_seqlen_q, int) and max_seqlen_q == max_seqlen_k
        calls.append(("varlen", q.shape, k.shape, cu_seqlens_q.tolist(), max_seqlen_q, causal))
        bounds = cu_seqlens_q.tolist()
        outs = []
        for start, end in itertools.pairwise(bounds):
            # One document: (len, H, D) -> (1, H, len, D)
            seg = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            o = eager(*seg, causal=causal, dropout_p=dropout_p, scale=softmax_scale, docs=None)
            outs.append(o.squeeze(0).transpose(0, 1))
        return torch.cat(outs)

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module
