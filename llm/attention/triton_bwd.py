"""FlashAttention-2 backward kernels (Dao 2023, algorithm 2) in Triton.

P is recomputed block by block from Q, K and the saved log-sum-exp, never stored. Two
kernels instead of FlashAttention-2's one with atomic dQ adds:
- ``flash_bwd_dkdv_kernel``: a program owns BLOCK_N keys of one K/V head and streams the
  query blocks of every query head in its GQA group past them, so dK and dV are summed
  over the group in registers and written once: no atomics, no repeated K/V in memory.
- ``flash_bwd_dq_kernel``: a program owns BLOCK_M query rows and streams the key blocks.
The price is computing QK^T and dO V^T twice (7 block matmuls instead of 5); what it buys
is deterministic gradients (fp32 atomics add in a varying order) and GQA without atomics
contending on the K/V head that a group shares.
"""

import triton
import triton.language as tl

from llm.attention.triton_configs import (
    DO_BENCH,
    dkdv_configs,
    dq_configs,
    prune_dkdv,
    prune_dq,
)
from llm.attention.triton_fwd import key_range, load_block

KEY = ["T", "HEAD_DIM", "CAUSAL", "HAS_DOCS"]


@triton.jit
def flash_bwd_delta_kernel(
    Out,
    DO,
    DELTA,
    stride_dob,
    stride_doh,
    stride_dot,
    H,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """DELTA = rowsum(dO * Out), (B, H, T) fp32: the softmax backward's per-row term; Out contiguous."""
    bh = tl.program_id(1).to(tl.int64)  # b * stride_b can pass 2**31 elements
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m[:, None] < T
    o = tl.load(
        Out + (bh * T + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_seq, other=0.0
    )
    do_rows = DO + (bh // H) * stride_dob + (bh % H) * stride_doh + offs_m[:, None] * stride_dot
    do = tl.load(do_rows + offs_d[None, :], mask=in_seq, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def dkdv_block_loop(
    dk, dv, k, v, doc_k, offs_n, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_ptr, stride_qt, stride_dot,
    start, end, T, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds the query blocks [start, end) of one head to dK, dV (BLOCK_N, HEAD_DIM), fp32."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_seq = offs_m < T
        q_t = load_block(
            q_ptr + offs_m[None, :] * stride_qt + offs_d[:, None], in_seq[None, :], MASKED
        )
        lse = load_block(lse_ptr + offs_m, in_seq, MASKED)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M) = S^T
        if MASKED:
            keep = in_seq[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            s_t = tl.where(keep, s_t, float("-inf"))
        if HAS_DOCS:
            doc_q = load_block(doc_ptr + offs_m, in_seq, MASKED)
            s_t = tl.where(doc_k[:, None] == doc_q[None, :], s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse[None, :])  # P^T recomputed from the saved log-sum-exp
        do = load_block(
            do_ptr + offs_m[:, None] * stride_dot + offs_d[None, :], in_seq[:, None], MASKED
        )
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        delta = load_block(delta_ptr + offs_m, in_seq, MASKED)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = dP^T
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(
    configs=dkdv_configs(),
    key=KEY,
    prune_configs_by={"early_config_prune": prune_dkdv},
    do_bench=DO_BENCH,
)
@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DOC, DOC_START, DOC_END,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
    stride_vt, stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt,
    H, N_REP, T, qk_scale, scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_N), B * Hkv). DK and DV share DK's strides."""
    key0 = tl.program_id(0) * BLOCK_N
    n_kv = H // N_REP
    b = (tl.program_id(1) // n_kv).to(tl.int64)  # b * stride_b can pass 2**31 elements
    hk = tl.program_id(1) % n_kv
    offs_n = key0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n[:, None] < T
    k_rows = K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_rows = V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
    k = tl.load(k_rows, mask=kv_mask, other=0.0)
    v = tl.load(v_rows, mask=kv_mask, other=0.0)
    doc_ptr = DOC + b * T
    doc_k = tl.zeros([BLOCK_N], dtype=tl.int32)
    if HAS_DOCS:
        doc_k = tl.load(doc_ptr + tl.minimum(offs_n, T - 1))

    # Queries that can see these keys: from the first key's document start (and, causal, from
    # the first key itself) to the last key's document end.
    lo = 0
    hi = T
    if CAUSAL:
        lo = key0
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(DOC_START + b * T + key0))
        hi = tl.load(DOC_END + b * T + tl.minimum(key0 + BLOCK_N, T) - 1)
    lo = (lo // BLOCK_M) * BLOCK_M
    # Query blocks starting at or after the last key see every key: no causal mask from there.
    diag_end = lo
    if CAUSAL:
        diag_end = lo + tl.cdiv(key0 + BLOCK_N - 1 - lo, BLOCK_M) * BLOCK_M
    tail = tl.maximum(
        diag_end, tl.minimum((T // BLOCK_M) * BLOCK_M, tl.cdiv(hi, BLOCK_M) * BLOCK_M)
    )

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for r in range(N_REP):
        h = hk * N_REP + r
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_dob + h * stride_doh
        lse_ptr = LSE + (b * H + h) * T
        delta_ptr = DELTA + (b * H + h) * T
        dk, dv = dkdv_block_loop(
            dk, dv, k, v, doc_k, offs_n, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_ptr, stride_qt,
            stride_dot, lo, tl.minimum(diag_end, hi), T, qk_scale,
            HEAD_DIM, BLOCK_M, True, CAUSAL, HAS_DOCS, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = dkdv_block_loop(
            dk, dv, k, v, doc_k, offs_n, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_ptr, stride_qt,
            stride_dot, diag_end, tail, T, qk_scale,
            HEAD_DIM, BLOCK_M, False, CAUSAL, HAS_DOCS, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = dkdv_block_loop(
            dk, dv, k, v, doc_k, offs_n, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_ptr, stride_qt,
            stride_dot, tail, hi, T, qk_scale,
            HEAD_DIM, BLOCK_M, True, CAUSAL, HAS_DOCS, DOT_PRECISION,
        )  # fmt: skip

    out = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def dq_block_loop(
    dq, q, do, lse, delta, doc_q, offs_m, k_ptr, v_ptr, doc_ptr, stride_kt, stride_vt,
    start, end, T, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds the key blocks [start, end) to dQ (BLOCK_M, HEAD_DIM), fp32, unscaled."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        k_t = load_block(
            k_ptr + offs_n[None, :] * stride_kt + offs_d[:, None], in_seq[None, :], MASKED
        )
        v_t = load_block(
            v_ptr + offs_n[None, :] * stride_vt + offs_d[:, None], in_seq[None, :], MASKED
        )
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = in_seq[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        if HAS_DOCS:
            doc_k = load_block(doc_ptr + offs_n, in_seq, MASKED)
            s = tl.where(doc_q[:, None] == doc_k[None, :], s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(
    configs=dq_configs(),
    key=KEY,
    prune_configs_by={"early_config_prune": prune_dq},
    do_bench=DO_BENCH,
)
@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, DOC, DOC_START, DOC_END,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
    stride_vt, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
    H, N_REP, T, qk_scale, scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_M), B * H); walks the same key blocks as the forward kernel."""
    row0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # b * stride_b can pass 2**31 elements
    b = bh // H
    h = bh % H
    hk = h // N_REP
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < T
    rows = offs_m[:, None]
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows * stride_qt + offs_d[None, :],
        mask=in_seq[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows * stride_dot + offs_d[None, :],
        mask=in_seq[:, None],
        other=0.0,
    )
    lse = tl.load(LSE + bh * T + offs_m, mask=in_seq, other=0.0)
    delta = tl.load(DELTA + bh * T + offs_m, mask=in_seq, other=0.0)
    k_ptr = K + b * stride_kb + hk * stride_kh
    v_ptr = V + b * stride_vb + hk * stride_vh
    doc_ptr = DOC + b * T
    doc_q = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_DOCS:
        doc_q = tl.load(doc_ptr + tl.minimum(offs_m, T - 1))

    lo, mid, hi = key_range(
        DOC_START + b * T, DOC_END + b * T, row0, T, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N
    )

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = dq_block_loop(
        dq, q, do, lse, delta, doc_q, offs_m, k_ptr, v_ptr, doc_ptr, stride_kt, stride_vt,
        lo, mid, T, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_DOCS, DOT_PRECISION,
    )  # fmt: skip
    dq = dq_block_loop(
        dq, q, do, lse, delta, doc_q, offs_m, k_ptr, v_ptr, doc_ptr, stride_kt, stride_vt,
        mid, hi, T, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_DOCS, DOT_PRECISION,
    )  # fmt: skip
    out = DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqt + offs_d[None, :]
    tl.store(out, (dq * scale).to(DQ.dtype.element_ty), mask=in_seq[:, None])
