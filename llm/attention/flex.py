"""torch's FlexAttention, compiled: a fused kernel generated for the mask (causal, or a
document BlockMask whose fully masked blocks are skipped).

Compiled once per process (``torch.compile(flex_attention)``) and again for each new shape;
without compile, or past dynamo's recompile limit (8 shapes; torch warns), torch runs an
unfused reference that materialises the scores. torch 2.13 has no FlexAttention backward on
CPU: any CPU call whose inputs require grad raises (compiled or not), so on CPU it evaluates
(forward under no_grad, compiled to C++ by inductor) and training is refused. No dropout.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from llm.attention.documents import Documents
from llm.attention.support import FLOATS, Support
from llm.errors import ConfigError

SUPPORT = {
    "cpu": Support(dropout=False, backward=False),
    "cuda": Support(dtypes=FLOATS, min_head_dim=16, dropout=False),
}


@cache
def compiled_flex():
    """The compiled kernel, made on first use (compiling costs seconds, once per process)."""
    return torch.compile(flex_attention)


def _causal(q, kv):
    return q >= kv


@cache
def _causal_block_mask(t: int, device: torch.device):
    return create_block_mask(lambda b, h, q, kv: _causal(q, kv), None, None, t, t, device=device)


def flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float,
    docs: Documents | None,
) -> Tensor:
    if dropout_p > 0.0:
        raise ConfigError("attention=flex has no attention dropout; set model.dropout=0")
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise ConfigError(
            "attention=flex has no backward on CPU in torch 2.13 (evaluation only); train with "
            "attention=sdpa or eager on CPU, or use a GPU"
        )
    if docs is not None:
        block_mask = docs.block_mask(causal)
    else:
        block_mask = _causal_block_mask(q.size(2), q.device) if causal else None
    return compiled_flex()(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )  # (B, H, T, D)
