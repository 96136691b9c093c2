"""xFormers' ``memory_efficient_attention`` (``xformers.ops``), an optional package:
``pip install xformers`` on a CUDA machine, in the build made for this torch.

The kernel the FlashAttention papers compare against. xFormers dispatches each call itself:
FlashAttention-2/3 for fp16/bf16 on sm80+, its CUTLASS kernel (torch's "efficient" kernel)
for fp32 and older GPUs. It takes (B, T, H, D) ("BMHK"), not our (B, H, T, D): since the
models make q, k and v as (B, T, H, D) views transposed to (B, H, T, D), transposing back
is free. Causal masking is a ``LowerTriangularMask``; with document masking the batch is
flattened to (1, B*T, H, D) and cut into documents by a ``BlockDiagonal(Causal)Mask``
(``Documents.xformers_mask``), so no score is computed across two documents.

Grouped-query attention: K and V are repeated to the query heads (``repeat_kv``, a copy).
xFormers reads grouped heads only in its 5-D (B, T, G, H, D) form with stride-0 K/V, and
only in the forward: none of its backward operators (flash, flash3, cutlass) accepts that
form, so training would fail there. Repeating is the one form that trains; autograd sums
the repeated heads' dK and dV back onto each kv head. The copies are what autograd saves.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from llm.attention.documents import Documents
from llm.attention.eager import repeat_kv
from llm.attention.support import FLOATS, Support, package_missing
from llm.errors import ConfigError

# CUDA only. fp16/bf16 run FlashAttention inside xFormers (sm80+, head dim <= 256, a multiple
# of 8); fp32 runs its CUTLASS kernel (head dims aligned to 4 on sm80+, larger ones allowed):
# the set every path takes is declared. Dropout and both masks run forward and backward.
SUPPORT = {"cuda": Support(dtypes=FLOATS, max_head_dim=256, head_dim_multiple=8)}

_INSTALL = "pip install xformers on a CUDA machine (the release built for this torch)"


def _ops():
    """``xformers.ops``, or a ConfigError naming the problem and the fix."""
    try:
        return importlib.import_module("xformers.ops")
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or a build for another torch
        raise ConfigError(package_missing("xformers", "xformers", e, _INSTALL)) from None


def unavailable() -> str | None:
    try:
        _ops()
    except ConfigError as e:
        return str(e)
    return None


def xformers(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
) -> Tensor:
    xops = _ops()
    b, h, t, d = q.shape
    n_rep = h // k.size(1)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, D): xFormers' BMHK needs H
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D)
    if docs is None:
        bias = xops.LowerTriangularMask() if causal else None
    else:
        bias = docs.xformers_mask(causal)
        q, k, v = (x.reshape(1, b * t, h, d) for x in (q, k, v))  # one row of B*T tokens
    out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout_p, scale=scale)
    return out.reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
