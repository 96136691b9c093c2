"""Parameter and FLOP counts from the shape alone (no model needed, so sweeps can plan)."""

from __future__ import annotations

from llm.models.args import ModelArgs


def _block_params(a: ModelArgs) -> int:
    d, kv = a.d_model, a.n_kv_heads * a.head_dim
    attn = 2 * d * d + 2 * d * kv  # wq, wo (d x d); wk, wv (d x kv)
    if a.family == "gpt2":
        attn += 2 * d + 2 * kv  # biases
        mlp = 2 * d * a.d_ff + a.d_ff + d  # w1, w2 and their biases
        norms = 2 * 2 * d  # two LayerNorms, gain and bias
    else:
        mlp = 3 * d * a.d_ff  # w1, w3, w2
        norms = 2 * d  # two RMSNorm gains
    return attn + mlp + norms


def num_params(args: ModelArgs, *, exclude_embeddings: bool = False) -> int:
    """Parameters of the model built from ``args``, tied weights counted once.

    ``exclude_embeddings``: drop the token and position tables and the output head (Kaplan et
    al. 2020's "non-embedding" N; for tied GPT-2 the head is the token table anyway).
    """
    final_norm = args.d_model * (2 if args.family == "gpt2" else 1)
    body = args.n_layers * _block_params(args) + final_norm
    if exclude_embeddings:
        return body
    tables = args.vocab_size * args.d_model
    if args.family == "gpt2":
        tables += args.max_seq_len * args.d_model
    if not args.tie_embeddings:
        tables += args.vocab_size * args.d_model  # the output head
    return body + tables


def _matmul_params(args: ModelArgs) -> int:
    """N of the 6N term: every weight a token is multiplied by (see flops_per_token)."""
    return num_params(args, exclude_embeddings=True) + args.vocab_size * args.d_model


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
    """
    attention = 6.0 * args.n_layers * (seq_len + 1) * _attention_width(args)
    return 6.0 * _matmul_params(args) + attention
