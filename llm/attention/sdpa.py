"""PyTorch's fused scaled_dot_product_attention: it picks flash, memory-efficient, cuDNN or
math kernels by device, dtype and shape, so the (T, T) scores are usually never stored."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, dropout_p: float) -> Tensor:
    # enable_gqa lets kernels that support it read grouped K/V in place instead of a repeated copy.
    gqa = q.size(1) != k.size(1)
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa
    )  # (B, H, T, D)
