"""The autograd Function around our Triton kernels: loading them, launching them, and what
forward saves for backward (Q, K, V, O and the (B, H, T) log-sum-exp: O(T) per head)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor

LOG2E = math.log2(math.e)
_DELTA_BLOCK = 64


def _kernels() -> SimpleNamespace:
    """The jitted kernels, imported on first use so that the repo imports without triton."""
    from llm.attention import triton_bwd, triton_fwd

    return SimpleNamespace(
        fwd=triton_fwd.flash_fwd_kernel,
        delta=triton_bwd.flash_bwd_delta_kernel,
        dkdv=triton_bwd.flash_bwd_dkdv_kernel,
        dq=triton_bwd.flash_bwd_dq_kernel,
    )


def tuned_kernels() -> dict:
    """The autotuned kernels by name (their ``cache`` maps tuning keys to chosen configs)."""
    kern = _kernels()
    return {"forward": kern.fwd, "backward_dkdv": kern.dkdv, "backward_dq": kern.dq}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(x: Tensor) -> tuple[int, int, int]:
    """Batch, head and time strides of a (B, H, T, D) tensor whose last dim is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _constexprs(q: Tensor, causal: bool, has_docs: bool) -> dict:
    # fp32 is for tests: exact fp32 products, not TF32, so errors stay at fp32 rounding.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return {
        "HEAD_DIM": q.size(-1),
        "CAUSAL": causal,
        "HAS_DOCS": has_docs,
        "DOT_PRECISION": precision,
    }


class FlashAttentionFunction(torch.autograd.Function):
    """apply(q, k, v, causal, scale, [run, run_start, run_end]) -> o; see ``triton_flash``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, *docs):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        b, h, t, d = q.shape
        has_docs = bool(docs)
        if not has_docs:
            docs = (q.new_empty(1, dtype=torch.int32),) * 3  # never read when HAS_DOCS=False
        o = q.new_empty(b, h, t, d)
        lse = q.new_empty(b, h, t, dtype=torch.float32)  # base 2, scaled-score units
        _kernels().fwd[lambda meta: (_cdiv(t, meta["BLOCK_M"]), b * h)](
            q, k, v, o, lse, *docs,
            *_rows(q), *_rows(k), *_rows(v), *_rows(o),
            h, h // k.size(1), t, scale * LOG2E,
            **_constexprs(q, causal, has_docs),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse, *docs)
        ctx.causal, ctx.scale, ctx.has_docs = causal, scale, has_docs
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *docs = ctx.saved_tensors
        do = _last_dim_contiguous(do)
        b, h, t, d = q.shape
        n_kv = k.size(1)
        kern = _kernels()
        delta = torch.empty_like(lse)
        kern.delta[(_cdiv(t, _DELTA_BLOCK), b * h)](
            o, do, delta, *_rows(do), h, t, HEAD_DIM=d, BLOCK_M=_DELTA_BLOCK
        )
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        common = (h, h // n_kv, t, ctx.scale * LOG2E, ctx.scale)
        meta = _constexprs(q, ctx.causal, ctx.has_docs)
        kern.dkdv[lambda m: (_cdiv(t, m["BLOCK_N"]), b * n_kv)](
            q, k, v, do, dk, dv, lse, delta, *docs,
            *_rows(q), *_rows(k), *_rows(v), *_rows(do), *_rows(dk),
            *common, **meta,
        )  # fmt: skip
        kern.dq[lambda m: (_cdiv(t, m["BLOCK_M"]), b * h)](
            q, k, v, do, dq, lse, delta, *docs,
            *_rows(q), *_rows(k), *_rows(v), *_rows(do), *_rows(dq),
            *common, **meta,
        )  # fmt: skip
        return dq, dk, dv, None, None, *((None,) * 3 if ctx.has_docs else ())
