"""The flash-attn package (Dao et al.), an optional extra: ``pip install -e .[flash]``.

Its kernels take (B, T, H, D), not our (B, H, T, D): since the models make q, k and v as
(B, T, H, D) views transposed to (B, H, T, D), transposing back is free. K and V keep their
Hkv heads (the package reads grouped heads natively). With document masking the batch is
flattened to (B*T, H, D) and cut into documents by ``cu_seqlens`` for
``flash_attn_varlen_func``, which never computes a score across two documents.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from llm.attention.documents import Documents
from llm.attention.support import HALVES, Support, package_missing
from llm.errors import ConfigError

# flash-attn 2 on Ampere, Ada and Hopper GPUs.
SUPPORT = {"cuda": Support(dtypes=HALVES, max_head_dim=256, head_dim_multiple=8)}

_INSTALL = "pip install -e .[flash] on a CUDA machine (it builds against CUDA)"


def unavailable() -> str | None:
    try:
        importlib.import_module("flash_attn")
    except ImportError as e:
        return package_missing("flash_attn", "flash-attn", e, _INSTALL)
    return None


def _package():
    try:
        return importlib.import_module("flash_attn")
    except ImportError as e:
        raise ConfigError(package_missing("flash_attn", "flash-attn", e, _INSTALL)) from None


def flash_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
) -> Tensor:
    fa = _package()
    b, h, t, d = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H or Hkv, D)
    if docs is None:
        out = fa.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=causal)
    else:
        cu_seqlens, max_seqlen = docs.varlen
        out = fa.flash_attn_varlen_func(
            q.reshape(b * t, h, d),
            k.reshape(b * t, -1, d),
            v.reshape(b * t, -1, d),
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=causal,
        ).view(b, t, h, d)
    return out.transpose(1, 2)  # (B, H, T, D)
