"""Decode attention through a block table in Triton: vLLM's PagedAttention read, written the
way our FlashAttention forward (llm/attention/triton_fwd.py) is, with an online softmax.

One program per (sequence, kv head), not per query head: decode reads every cached key and
value once per step and does two small products with each, so it is bound by memory, and a
program that serves the whole group of query heads reading one kv head (GQA: H // Hkv of
them, MQA: all H) reads each K/V block from memory once instead of once per query head. The
group is one tile of query rows, padded to 16 (tl.dot's smallest M), so the products run on
tensor cores.

The program walks the sequence's positions TILE keys at a time: position p lives in block
table[p // block_size] at row p % block_size, so a tile gathers its keys through the table
(block_size is a power of two: the divide and remainder are shifts). Keys past seq_len (the
last block's unused rows, the table's padding) are masked and never contribute.

Imports triton at the top: ``paged_attention`` imports this module only when the kernel is
asked for. CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1 was set before
triton was imported (tests only, as for our FlashAttention).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from llm.attention.triton_flash import triton_interpreter_problem
from llm.errors import ConfigError

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK_SIZE = 16
HEAD_DIMS = (16, 32, 64, 128, 256)
TILE = 64  # keys per loop step: four blocks of 16, or part of one larger block
LOG2E = math.log2(math.e)


@triton.jit
def paged_decode_kernel(
    Q,
    K,
    V,
    Out,
    TABLE,
    SEQ_LENS,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kblk,
    stride_kt,
    stride_vh,
    stride_vblk,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_tb,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (B, Hkv). Q, Out (B, H, D); K, V (Hkv, n_blocks, BLOCK_SIZE, D); TABLE (B, M)
    int32; SEQ_LENS (B,) int32, each >= 1. Last dims contiguous."""
    b = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = hk * GROUP + offs_g  # the query heads that read kv head hk
    in_group = offs_g < GROUP
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=in_group[:, None], other=0.0)  # (GROUP_PAD, D); padding rows 0
    k_head = K + hk * stride_kh
    v_head = V + hk * stride_vh
    table = TABLE + b * stride_tb

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    # Every tile holds at least one position < seq_len, so no row's max stays -inf.
    for start in range(0, seq_len, TILE):
        pos = start + tl.arange(0, TILE)
        live = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        # K read transposed, (D, TILE), so q @ kT needs no shuffle.
        k_ptrs = k_head + (block * stride_kblk + row * stride_kt)[None, :] + offs_d[:, None]
        k = tl.load(k_ptrs, mask=live[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (GROUP_PAD, TILE), log2
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_head + (block * stride_vblk + row * stride_vt)[:, None] + offs_d[None, :]
        v = tl.load(v_ptrs, mask=live[:, None], other=0.0)  # (TILE, D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    o_rows = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_rows, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=in_group[:, None])


def _check(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor):
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ConfigError(
            f"paged triton attention wants q (B, H, D) and pools (Hkv, n_blocks, block_size, D); "
            f"got {tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    (b, h, d), (hkv, _, bs, dk) = q.shape, k_pool.shape
    if d != dk or h % hkv != 0:
        raise ConfigError(
            f"paged triton attention: q {tuple(q.shape)} and pool {tuple(k_pool.shape)} must share "
            "D, and the pool's kv head count must divide q's head count"
        )
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ConfigError(
            f"paged triton attention takes one dtype of {[str(x) for x in DTYPES]} for q and the "
            f"pools; got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    if bs < MIN_BLOCK_SIZE or bs & (bs - 1):
        raise ConfigError(
            f"paged triton attention needs a block size that is a power of two >= "
            f"{MIN_BLOCK_SIZE}, not {bs}; set generate.block_size to 16, 32, 64, ..."
        )
    if d not in HEAD_DIMS:
        raise ConfigError(
            f"paged triton attention supports head dims {HEAD_DIMS} (powers of two), not {d}; "
            "use generate.kernel=gather"
        )
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ConfigError(
            f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} must "
            f"have one row per sequence ({b})"
        )
    interpreted = triton.knobs.runtime.interpret and q.device.type == "cpu"
    if q.device.type != "cuda" and not interpreted:
        raise ConfigError(
            f"the paged triton kernel needs CUDA tensors, not {q.device} (on CPU it runs only in "
            "Triton's interpreter, TRITON_INTERPRET=1, for tests); use generate.kernel=gather"
        )
    if interpreted and (why := triton_interpreter_problem()):
        raise ConfigError(why)


# Under torch.compile the kernel runs as it is, outside the graph, as our FlashAttention does.
@torch.compiler.disable
def triton_paged_decode_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor
) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over each sequence's first seq_lens[b] cached tokens, read
    through its block table; shapes as in ``paged_attention``. Returns (B, H, D) in q's dtype."""
    _check(q, k_pool, v_pool, block_table, seq_lens)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(-1) == 1 else v_pool.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    (b, h, d), (hkv, _, bs, _) = q.shape, k_pool.shape
    group = h // hkv
    out = torch.empty_like(q)
    paged_decode_kernel[(b, hkv)](
        q, k_pool, v_pool, out, table, lens,
        q.stride(0), q.stride(1),
        *k_pool.stride()[:3], *v_pool.stride()[:3],
        out.stride(0), out.stride(1), table.stride(0),
        d**-0.5 * LOG2E,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=bs,
        TILE=TILE,
        # fp32 is exact fp32 products, not TF32, so it matches the gather reference closely.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    return out
