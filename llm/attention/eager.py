"""The reference backend: materialises the (B, H, T, T) scores, softmax in fp32.

Slow and memory-hungry on purpose (O(T^2) activations); every other backend is tested
against it, and it is the baseline in the attention-memory ablations. Its numerics are the
standard attention the papers measure against, and transformers' eager: in 16 bits, QK^T
and PV run in the input dtype, so the scores and the probabilities are rounded on the way.
On an H200 that put its bf16 error at head dim 128 above twice SDPA flash's (which keeps
both in fp32); the activation formulas (llm.estimate) and the experiments model these bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llm.attention.documents import Documents
from llm.attention.support import Support

SUPPORT = {"cpu": Support(), "cuda": Support()}


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D); query head h reads kv head h // n_rep (as HF)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
) -> Tensor:
    n_rep = q.size(1) // k.size(1)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, D)
    # fp32 scores so bf16 inputs do not lose the softmax's dynamic range.
    scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, T, T)
    if docs is not None:
        scores = scores.masked_fill(~docs.dense_mask(causal), float("-inf"))
    elif causal:
        t = q.size(2)
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v  # (B, H, T, D)
