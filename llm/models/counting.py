"""Parameter and FLOP counts from the shape alone (no model needed, so sweeps can plan)."""

from __future__ import annotations

from llm.models.args import ModelArgs


def _attention_params(a: ModelArgs) -> int:
    d, kv = a.d_model, a.n_kv_heads * a.head_dim
    attn = 2 * d * d + 2 * d * kv  # wq, wo (d x d); wk, wv (d x kv)
    if a.family == "gpt2":
        attn += 2 * d + 2 * kv  # biases
    return attn


def _dense_mlp_params(a: ModelArgs) -> int:
    if a.family == "gpt2":
        return 2 * a.d_model * a.d_ff + a.d_ff + a.d_model  # w1, w2 and their biases
    return 3 * a.d_model * a.d_ff  # w1, w3, w2


def _moe_params(a: ModelArgs, *, active: bool) -> int:
    """One MoE feed-forward (llm/models/moe.py): the router gate (E x d, no bias; a sigmoid
    router's bias is a buffer), the routed experts (3 * d * d_expert each; ``active``: the
    top_k a token goes to, else all E) and the shared experts (one SwiGLU of width
    n_shared_experts * d_expert, every token)."""
    moe, d = a.moe, a.d_model
    gate = moe.n_experts * d
    expert = 3 * d * a.d_expert
    routed = (moe.top_k if active else moe.n_experts) * expert
    shared = moe.n_shared_experts * expert
    return gate + routed + shared


def blocks_params(a: ModelArgs, *, active: bool = False) -> int:
    """All n_layers blocks: attention, two norms and the feed-forward, MoE where
    ``a.is_moe_layer(i)`` and dense elsewhere; ``active``: a MoE block's top_k experts."""
    norms = 2 * 2 * a.d_model if a.family == "gpt2" else 2 * a.d_model  # LayerNorm: gain, bias
    n_moe = sum(a.is_moe_layer(i) for i in range(a.n_layers))
    total = a.n_layers * (_attention_params(a) + norms)
    total += (a.n_layers - n_moe) * _dense_mlp_params(a)
    if n_moe:
        total += n_moe * _moe_params(a, active=active)
    return total


def num_params(args: ModelArgs, *, exclude_embeddings: bool = False) -> int:
    """Parameters of the model built from ``args``, tied weights counted once; a MoE model's
    every expert counted (:func:`num_active_params` counts those a token uses).

    ``exclude_embeddings``: drop the token and position tables and the output head (Kaplan et
    al. 2020's "non-embedding" N; for tied GPT-2 the head is the token table anyway).
    """
    return _count(args, exclude_embeddings=exclude_embeddings, active=False)


def num_active_params(args: ModelArgs, *, exclude_embeddings: bool = False) -> int:
    """Parameters a token is multiplied by: as :func:`num_params`, but each MoE block's
    routed experts count top_k of n_experts. The router gate, shared experts, attention,
    norms, dense blocks and the tables (as num_params counts them) count whole, so for a
    dense model this is num_params. Mixtral-8x7B: 46.7B parameters, 12.9B active.
    """
    return _count(args, exclude_embeddings=exclude_embeddings, active=True)


def _count(args: ModelArgs, *, exclude_embeddings: bool, active: bool) -> int:
    final_norm = args.d_model * (2 if args.family == "gpt2" else 1)
    body = blocks_params(args, active=active) + final_norm
    if exclude_embeddings:
        return body
    tables = args.vocab_size * args.d_model
    if args.family == "gpt2":
        tables += args.max_seq_len * args.d_model
    if not args.tie_embeddings:
        tables += args.vocab_size * args.d_model  # the output head
    return body + tables


def _matmul_params(args: ModelArgs) -> int:
    """N of the 6N term: every weight a token is multiplied by (see flops_per_token): the
    active non-embedding parameters plus the output projection."""
    return num_active_params(args, exclude_embeddings=True) + args.vocab_size * args.d_model


def _attention_width(args: ModelArgs) -> int:
    """n_heads * head_dim: the query width, which sets the attention FLOPs whatever the
    number of key/value heads (GQA shares k/v between query heads, each still scores)."""
    return args.n_heads * args.head_dim


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len``, by the
    convention of the MFU figures we compare against (PaLM, Chowdhery et al. 2022, appendix
    B; nanoGPT's ``estimate_mfu``; torchtitan):

        flops = 6 * N + 12 * n_layers * seq_len * d_attn      (d_attn = n_heads * head_dim)

    Dense part (Kaplan et al. 2020; Chinchilla, Hoffmann et al. 2022, appendix F): a matmul
    with N weights costs 2N per token forward and 4N backward. N = non-embedding parameters
    plus the output projection (V * d_model, counted whether or not it is tied, since it is a
    matmul either way); the token and position lookups are not matmuls and are left out.
    Norm gains and biases ride along in N (<0.1%).

    Mixture of experts (Switch, Fedus et al. 2022; DeepSeekMoE, Dai et al. 2024): N is the
    active count (:func:`num_active_params`), each MoE block's routed experts counted top_k
    of n_experts since a token passes through only those; the router gate (d x E) is a
    matmul every token does and counts, as do the shared experts. Routing's softmax, top-k
    and the weighted sum are not matmuls and are left out.

    Attention part: per token and layer the forward pass computes QK^T and AV against all
    ``seq_len`` keys, each 2 * seq_len * d_attn FLOPs, so 4 * L * T * d_attn forward and
    12 * L * T * d_attn for training. The convention counts every score, although a causal
    kernel skips the masked half (:func:`causal_flops_per_token` counts what it computes).
    With grouped-query attention the queries keep n_heads heads, so this term does not
    change; the smaller k/v projections shrink N.
    """
    return 6.0 * _matmul_params(args) + 12.0 * args.n_layers * seq_len * _attention_width(args)


def causal_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token that a causal kernel actually computes: the token at
    position i (0-based) scores i + 1 keys, (T + 1) / 2 on average, so the attention term
    is 6 * L * (T + 1) * d_attn, a little over half the convention's (:func:`flops_per_token`).
    The 6N term is the same: N the active parameters plus the output projection.
    """
    attention = 6.0 * args.n_layers * (seq_len + 1) * _attention_width(args)
    return 6.0 * _matmul_params(args) + attention
