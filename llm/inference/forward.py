"""The model's forward with a KV cache: the same modules and weights as training's
Transformer.forward (llm/models/transformer.py), but each attention writes its new keys and
values into the cache and reads the earlier ones from it.

Two calls: :func:`prefill` runs new sequences' prompts (T tokens each, positions 0..T-1,
causal over themselves) and :func:`decode` runs one new token per sequence at its own
position against everything cached. Either returns logits (B, T, V) for the new tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm.models import Transformer
from llm.models.layers import Attention, apply_rope, rope_inv_freq


def _attention(
    attn: Attention, x: Tensor, positions: Tensor, cache, layer: int, new: bool
) -> Tensor:
    """x (B, T, d) at ``positions`` (B, T) -> attention output (B, T, d)."""
    b, t, _ = x.shape
    a = attn.args
    q = attn.wq(x).view(b, t, attn.n_heads, a.head_dim).transpose(1, 2)  # (B, H, T, D)
    k = attn.wk(x).view(b, t, attn.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
    v = attn.wv(x).view(b, t, attn.n_kv_heads, a.head_dim).transpose(1, 2)
    if a.family == "llama":
        q, k = apply_rope(q, k, rope_inv_freq(a, x.device), positions)
    cache.write(layer, k, v)
    # A prompt attends to itself (nothing cached before it); a decode token to its cache.
    y = cache.prefill_attention(q, k, v) if new else cache.attend(layer, q)
    y = y.transpose(1, 2).reshape(b, t, attn.n_heads * a.head_dim)
    return attn.wo(y)


def _forward(
    model: Transformer, tokens: Tensor, positions: Tensor, cache, seqs: list[int], new: bool
) -> Tensor:
    cache.begin_step(seqs, tokens.size(1), tokens.device)
    h = model.tok_embeddings(tokens)  # (B, T, d)
    if model.args.family == "gpt2":
        h = h + model.pos_embeddings(positions)
    for i, block in enumerate(model.layers):
        x = block.attention_norm(h)
        h = h + _attention(block.attention, x, positions, cache, i, new)
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.advance(seqs, tokens.size(1))
    return model.output(model.norm(h))  # (B, T, V)


@torch.no_grad()
def prefill(model: Transformer, tokens: Tensor, cache, seqs: list[int]) -> Tensor:
    """Prompts ``tokens`` (B, T) of sequences ``seqs`` just added to ``cache`` (empty, with
    room for T tokens each) -> logits (B, T, V)."""
    positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    return _forward(model, tokens, positions, cache, seqs, new=True)


@torch.no_grad()
def decode(model: Transformer, tokens: Tensor, cache, seqs: list[int]) -> Tensor:
    """One token per sequence, ``tokens`` (B,), each at the position after its cached ones
    (room for it already made with ``cache.extend``) -> logits (B, V)."""
    positions = torch.tensor([[cache.lens[s]] for s in seqs], device=tokens.device)  # (B, 1)
    return _forward(model, tokens[:, None], positions, cache, seqs, new=False)[:, 0]
