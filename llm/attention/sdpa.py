"""PyTorch's fused scaled_dot_product_attention, with its kernel chosen by
``attention.sdpa_kernel``: auto (torch picks) or one of flash, efficient, cudnn, math.

A named kernel is the only one enabled (``torch.nn.attention.sdpa_kernel``), so torch cannot
fall back to another; when it cannot run the call, the refusal is one ConfigError carrying
torch's own reasons. What each kernel takes, by device (torch 2.13; the CPU rows measured
by tests/test_attention_backends.py, the CUDA rows from torch's sdp_utils checks):

- math: everything, on CPU and CUDA; materialises the (T, T) scores like eager.
- flash: CPU: fp32/bf16/fp16, any head dim, a mask (document masking), no dropout.
  CUDA (sm80+): bf16/fp16, head dim <= 256, dropout, no mask (no document masking).
- efficient: CUDA only; fp32/bf16/fp16, head dim a multiple of 8, mask and dropout.
- cudnn: CUDA only (sm80+); bf16/fp16, head dim <= 128 and a multiple of 8, mask, dropout
  in multiples of 1/16.
Nothing but math and flash exists on CPU.
"""

from __future__ import annotations

import contextlib
import warnings

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from llm.attention.documents import Documents
from llm.attention.support import FLOATS, HALVES, Support
from llm.errors import ConfigError

KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}

SUPPORT = {
    "auto": {"cpu": Support(), "cuda": Support()},
    "math": {"cpu": Support(), "cuda": Support()},
    "flash": {
        "cpu": Support(dropout=False),
        "cuda": Support(dtypes=HALVES, max_head_dim=256, document_mask=False),
    },
    "efficient": {"cuda": Support(dtypes=FLOATS, head_dim_multiple=8)},
    "cudnn": {"cuda": Support(dtypes=HALVES, max_head_dim=128, head_dim_multiple=8)},
}


def _call(q, k, v, causal, dropout_p, scale, docs) -> Tensor:
    # enable_gqa lets kernels that support it read grouped K/V in place instead of a repeated copy.
    mask = None if docs is None else docs.dense_mask(causal)  # the mask holds causality too
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.size(1) != k.size(1),
    )  # (B, H, T, D)


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
    kernel: str = "auto",
) -> Tensor:
    if kernel == "auto":
        return _call(q, k, v, causal, dropout_p, scale, docs)
    try:
        with sdpa_kernel(KERNELS[kernel]):
            return _call(q, k, v, causal, dropout_p, scale, docs)
    except RuntimeError as e:
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        raise ConfigError(
            f"attention.sdpa_kernel={kernel} cannot run q {tuple(q.shape)} {q.dtype} on "
            f"{q.device.type} ({_reasons(q, k, v, causal, dropout_p, scale, docs, kernel)}); "
            "use attention.sdpa_kernel=auto or another kernel"
        ) from None


def _reasons(q, k, v, causal, dropout_p, scale, docs, kernel: str) -> str:
    """Torch's own explanation: it warns why each kernel was rejected before raising."""
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(KERNELS[kernel]):
        warnings.simplefilter("always")
        with contextlib.suppress(RuntimeError):
            _call(q, k, v, causal, dropout_p, scale, docs)
    said = [str(w.message).split("(Triggered")[0].strip() for w in caught]
    return "; ".join(s for s in said if s and "not used because" not in s) or "no reason given"
