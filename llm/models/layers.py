"""The pieces both families are built from: norms, rotary embeddings, attention, MLPs."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from llm.attention import Documents, attention, get_kernel
from llm.models.args import ModelArgs, RopeScaling


class RMSNorm(nn.Module):
    """Llama's norm, computed in fp32 and cast back before the gain, exactly as HF's LlamaRMSNorm
    (so bf16 runs round at the same place)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(args: ModelArgs, device: torch.device) -> Tensor:
    """(D/2,) fp32 inverse frequencies theta^(-2i/D), with llama3 rescaling when configured."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    return inv_freq if args.rope_scaling is None else _llama3_scale(inv_freq, args.rope_scaling)


def _llama3_scale(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    # Same arithmetic as HF's _compute_llama3_parameters, so Llama-3.x checkpoints match.
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    # HF's convention (halves, not interleaved pairs), so HF Llama weights need no permutation.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: Tensor, k: Tensor, inv_freq: Tensor, positions: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Rotate q (B, H, T, D) and k (B, Hkv, T, D) by their positions: 0..T-1, or
    ``positions`` (B, T) (restarting at each packed document)."""
    if positions is None:
        pos = torch.arange(q.size(2), device=q.device, dtype=torch.float32)
    else:
        pos = positions.float().unsqueeze(1)  # (B, 1, T): one set of angles for all heads
    freqs = pos.unsqueeze(-1) * inv_freq  # (T, D/2) or (B, 1, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D) or (B, 1, T, D)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (each shards cleanly column-wise
    under tensor parallelism, which a fused qkv does not); RoPE when the family uses it."""

    def __init__(self, args: ModelArgs, backend: str, sdpa_kernel: str = "auto") -> None:
        super().__init__()
        get_kernel(backend, sdpa_kernel)  # an unknown name fails at build time, not at a step
        self.args, self.backend, self.kernel = args, backend, sdpa_kernel
        # Heads this module computes: all of them, or this rank's share once tensor parallel
        # splits wq/wk/wv by columns (llm/parallel/tensor_parallel.py divides both).
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        bias = args.family == "gpt2"
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.d_model, args.d_model, bias=bias)
        self.wk = nn.Linear(args.d_model, kv_dim, bias=bias)
        self.wv = nn.Linear(args.d_model, kv_dim, bias=bias)
        self.wo = nn.Linear(args.d_model, args.d_model, bias=bias)
        self.resid_dropout = nn.Dropout(args.dropout)
        # recompute=selective sets it: the attention core is recomputed in backward.
        self.recompute_core = False
        # Tensor parallel sets it (llm/parallel/tp_rng.py): core_call(core, q, k, v) runs the
        # core on this rank's own dropout stream, since the heads it computes are its own.
        self.core_call: Callable[..., Tensor] | None = None

    def forward(
        self, x: Tensor, docs: Documents | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """x (B, T, d); ``docs``: packed documents to keep apart; ``positions`` (B, T) for
        RoPE when they restart at each document."""
        b, t, _ = x.shape  # (B, T, d)
        a = self.args
        q = self.wq(x).view(b, t, self.n_heads, a.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, self.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(b, t, self.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if a.family == "llama":
            # Recomputed per call from the shape (a few T x D/2 ops): no buffer for to_empty to
            # leave as garbage or for .to(bf16) to round.
            q, k = apply_rope(q, k, rope_inv_freq(a, x.device), positions)
        p = a.dropout if self.training else 0.0
        core = partial(
            attention, causal=True, backend=self.backend, dropout_p=p, docs=docs, kernel=self.kernel
        )
        # recompute=selective keeps q, k, v; backward reruns the core (scores, softmax,
        # dropout with the RNG state restored, or the fused kernel) instead of keeping what
        # it saves.
        run_core = partial(checkpoint, core, use_reentrant=False) if self.recompute_core else core
        if p > 0 and self.core_call is not None:
            y = self.core_call(run_core, q, k, v)  # (B, H, T, D)
        else:
            y = run_core(q, k, v)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * a.head_dim)
        return self.resid_dropout(self.wo(y))


class GeluMLP(nn.Module):
    """GPT-2's MLP: w2(gelu_tanh(w1 x)); tanh GELU is HF's "gelu_new"."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.d_model, args.d_ff)
        self.w2 = nn.Linear(args.d_ff, args.d_model)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))


class SwiGLU(nn.Module):
    """Llama's MLP: w2(silu(w1 x) * w3 x); w1/w3/w2 are HF's gate/up/down projections."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.w3 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.w2 = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))
