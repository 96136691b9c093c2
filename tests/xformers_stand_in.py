"""A stand-in for the xformers package (whose kernels run only on CUDA): modules named
xformers, xformers.ops, xformers.ops.fmha and xformers.ops.fmha.attn_bias with
``memory_efficient_attention`` and the mask classes our adapter uses, with xFormers'
signatures. It checks what the adapter hands it as xFormers' own input checks do (BMHK
tensors of one shape, query, key and value alike: no broadcasting of heads; a last
dimension of stride 1; a block-diagonal mask only over one row whose length it covers, its
offsets on the tensors' device), records each call, and computes with our eager backend.
Tests put it in sys.modules (``install``)."""

from __future__ import annotations

import itertools
import sys
import types

import torch

from llm.attention.eager import eager


class AttentionBias:
    pass


class LowerTriangularMask(AttentionBias):
    def __init__(self, device=None) -> None:
        pass


class _SeqLenInfo:
    def __init__(self, seqstart_py: list[int], device) -> None:
        self.seqstart_py = seqstart_py
        self.seqstart = torch.tensor(seqstart_py, dtype=torch.int32, device=device)
        self.max_seqlen = max(b - a for a, b in itertools.pairwise(seqstart_py))


class BlockDiagonalMask(AttentionBias):
    def __init__(self, q_seqinfo: _SeqLenInfo, k_seqinfo: _SeqLenInfo) -> None:
        self.q_seqinfo, self.k_seqinfo = q_seqinfo, k_seqinfo

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        assert kv_seqlen is None, "self-attention: the keys are cut as the queries"
        assert all(isinstance(n, int) and n > 0 for n in q_seqlen), q_seqlen
        info = _SeqLenInfo([0, *itertools.accumulate(q_seqlen)], device or "cpu")
        return cls(q_seqinfo=info, k_seqinfo=info)

    def make_causal(self) -> BlockDiagonalCausalMask:
        return BlockDiagonalCausalMask(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo)


class BlockDiagonalCausalMask(BlockDiagonalMask):
    pass


def _eager(query, key, value, bias, p, scale):
    """Attention of BMHK tensors under ``bias`` (None, causal or block-diagonal), by eager."""
    if bias is None or type(bias) is LowerTriangularMask:
        out = eager(
            *(x.transpose(1, 2) for x in (query, key, value)),  # (B, M, H, K) -> (B, H, M, K)
            causal=bias is not None, dropout_p=p, scale=scale, docs=None,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous()
    causal = type(bias) is BlockDiagonalCausalMask
    outs = []
    for start, end in itertools.pairwise(bias.q_seqinfo.seqstart_py):
        # One document: (1, len, H, K) -> (1, H, len, K)
        seg = [x[:, start:end].transpose(1, 2) for x in (query, key, value)]
        o = eager(*seg, causal=causal, dropout_p=p, scale=scale, docs=None)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


class _FMHA(torch.autograd.Function):
    """Saves what xFormers' autograd function saves (query, key, value, the output and a
    (B, H, M) fp32 log-sum-exp), so saved-bytes measurements see the adapter's real
    inputs; the backward recomputes with eager under the forward's RNG state (dropout)."""

    @staticmethod
    def forward(ctx, query, key, value, bias, p, scale):
        ctx.rng = torch.get_rng_state()
        out = _eager(query, key, value, bias, p, scale)
        b, m, h, _ = query.shape
        lse = query.new_zeros((b, h, m), dtype=torch.float32)  # its size, not its values
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.bias, ctx.p, ctx.scale = bias, p, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        inputs = [x.detach().requires_grad_() for x in (query, key, value)]
        # The recomputation's own saved tensors stay out of any memory counter (the real
        # kernel keeps none): these identity hooks shadow the counter's.
        hide = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), hide:
            torch.set_rng_state(ctx.rng)
            out = _eager(*inputs, ctx.bias, ctx.p, ctx.scale)
        return (*torch.autograd.grad(out, inputs, grad), None, None, None)


def stand_in(calls: list) -> dict[str, types.ModuleType]:
    """The four modules, by name, with ``memory_efficient_attention`` recording into ``calls``
    (kind of mask, q shape, k shape, p, scale, document offsets or None)."""

    def memory_efficient_attention(
        query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None
    ):
        if query.ndim != 4 or not query.shape == key.shape == value.shape:
            raise ValueError(
                f"Incompatible shapes for attention inputs: query {tuple(query.shape)}, key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}; expected BMHK, no broadcasting"
            )
        assert all(x.stride(-1) == 1 for x in (query, key, value)), "last dim stride must be 1"
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if attn_bias is None or type(attn_bias) is LowerTriangularMask:
            kind, bounds = ("full" if attn_bias is None else "causal"), None
        else:
            assert type(attn_bias) in (BlockDiagonalMask, BlockDiagonalCausalMask), attn_bias
            bounds = attn_bias.q_seqinfo.seqstart_py
            if query.shape[0] != 1 or bounds[-1] != query.shape[1]:
                raise ValueError(f"block-diagonal bias {bounds} needs (1, {bounds[-1]}, H, K)")
            assert attn_bias.q_seqinfo.seqstart.device == query.device
            kind = "block_causal" if type(attn_bias) is BlockDiagonalCausalMask else "block"
        calls.append((kind, tuple(query.shape), tuple(key.shape), p, scale, bounds))
        if not any(x.requires_grad for x in (query, key, value)):
            return _eager(query, key, value, attn_bias, p, scale)
        return _FMHA.apply(query, key, value, attn_bias, p, scale)

    attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    for cls in (AttentionBias, LowerTriangularMask, BlockDiagonalMask, BlockDiagonalCausalMask):
        setattr(attn_bias, cls.__name__, cls)
    fmha = types.ModuleType("xformers.ops.fmha")
    fmha.attn_bias = attn_bias
    fmha.memory_efficient_attention = memory_efficient_attention
    fmha.LowerTriangularMask, fmha.BlockDiagonalMask = LowerTriangularMask, BlockDiagonalMask
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha
    ops.memory_efficient_attention = memory_efficient_attention
    ops.LowerTriangularMask = LowerTriangularMask
    package = types.ModuleType("xformers")
    package.ops = ops
    return {
        "xformers": package,
        "xformers.ops": ops,
        "xformers.ops.fmha": fmha,
        "xformers.ops.fmha.attn_bias": attn_bias,
    }


def install(monkeypatch, calls: list | None = None) -> list:
    """Put the stand-in in sys.modules for one test; returns the list its calls go to."""
    calls = [] if calls is None else calls
    for name, module in stand_in(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls
