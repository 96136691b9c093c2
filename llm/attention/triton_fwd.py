"""FlashAttention-2 forward kernel (Dao 2023, algorithm 1) in Triton.

One program owns BLOCK_M query rows of one (batch, head) and walks the K/V blocks that can
reach them, keeping the running row max m, the running sum l and the unnormalised output
in registers (online softmax). It writes O and the row log-sum-exp (base 2, in units of the
scaled scores) that backward uses to recompute P without storing it.

Only ``triton_flash`` imports this module, lazily, and it loads it twice: compiled for CUDA
tensors and under Triton's interpreter for CPU tensors (see ``triton_flash._kernels``).
"""

import triton
import triton.language as tl

from llm.attention.triton_configs import DO_BENCH, fwd_configs, prune_fwd


@triton.jit
def key_range(
    DOC_START, DOC_END, row0, T, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK_M, BLOCK_N
):
    """Key blocks that rows [row0, row0 + BLOCK_M) may attend: [lo, hi), lo aligned to BLOCK_N,
    and mid: the blocks in [lo, mid) end before T and below the causal diagonal, so they need
    no tail or causal mask (documents are still checked).

    Documents are contiguous runs, so the rows' documents cover exactly the keys from the
    first row's document start to the last row's document end; blocks outside are skipped.
    """
    lo = 0
    hi = T
    if CAUSAL:
        hi = tl.minimum(T, row0 + BLOCK_M)
    if HAS_DOCS:
        last = tl.minimum(row0 + BLOCK_M, T) - 1
        lo = tl.load(DOC_START + row0)
        hi = tl.minimum(hi, tl.load(DOC_END + last))
    lo = (lo // BLOCK_N) * BLOCK_N
    unmasked_end = (T // BLOCK_N) * BLOCK_N
    if CAUSAL:
        unmasked_end = tl.minimum(unmasked_end, ((row0 + 1) // BLOCK_N) * BLOCK_N)
    return lo, tl.maximum(lo, tl.minimum(unmasked_end, hi)), hi


@triton.jit
def load_block(ptrs, mask, MASKED: tl.constexpr):
    """Zero-filled past T in MASKED blocks; the unmasked loops' blocks end at or before T, so
    their loads need no mask (and the compiler can vectorise them fully)."""
    return tl.load(ptrs, mask=mask, other=0) if MASKED else tl.load(ptrs)


@triton.jit
def fwd_block_loop(
    acc,
    l_i,
    m_i,
    q,
    doc_q,
    offs_m,
    k_ptr,
    v_ptr,
    doc_ptr,
    stride_kt,
    stride_vt,
    start,
    end,
    T,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key blocks [start, end). MASKED blocks may hold keys past T or past
    the causal diagonal; the others are checked for documents only."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        # K is read transposed, (HEAD_DIM, BLOCK_N), so q @ kT needs no shuffle.
        k = load_block(
            k_ptr + offs_n[None, :] * stride_kt + offs_d[:, None], in_seq[None, :], MASKED
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            keep = in_seq[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        if HAS_DOCS:
            doc_k = load_block(doc_ptr + offs_n, in_seq, MASKED)
            s = tl.where(doc_q[:, None] == doc_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # With documents a row may meet a block holding only other documents before its own:
        # its max stays -inf, and subtracting 0 gives exp2(-inf) = 0, not exp2(-inf + inf) = nan.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new) if HAS_DOCS else m_new
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_block(
            v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :], in_seq[:, None], MASKED
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(
    configs=fwd_configs(),
    key=["T", "HEAD_DIM", "CAUSAL", "HAS_DOCS"],
    prune_configs_by={"early_config_prune": prune_fwd},
    do_bench=DO_BENCH,
)
@triton.jit
def flash_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    DOC,
    DOC_START,
    DOC_END,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_ot,
    H,
    N_REP,
    T,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), B * H). Q, K, V, Out: last dim contiguous. LSE (B, H, T) fp32.
    DOC, DOC_START, DOC_END: (B, T) int32 run index, run start and run end per token."""
    row0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # b * stride_b can pass 2**31 elements
    b = bh // H
    h = bh % H
    hk = h // N_REP  # GQA: query head h reads K/V head h // N_REP, never a repeated copy
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_rows, mask=offs_m[:, None] < T, other=0.0)
    k_ptr = K + b * stride_kb + hk * stride_kh
    v_ptr = V + b * stride_vb + hk * stride_vh
    doc_ptr = DOC + b * T
    doc_q = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_DOCS:
        # Rows past T borrow the last row's document so that they never see an empty row.
        doc_q = tl.load(doc_ptr + tl.minimum(offs_m, T - 1))

    lo, mid, hi = key_range(
        DOC_START + b * T, DOC_END + b * T, row0, T, CAUSAL, HAS_DOCS, BLOCK_M, BLOCK_N
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = fwd_block_loop(
        acc, l_i, m_i, q, doc_q, offs_m, k_ptr, v_ptr, doc_ptr, stride_kt, stride_vt,
        lo, mid, T, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_DOCS, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = fwd_block_loop(
        acc, l_i, m_i, q, doc_q, offs_m, k_ptr, v_ptr, doc_ptr, stride_kt, stride_vt,
        mid, hi, T, qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_DOCS, DOT_PRECISION,
    )  # fmt: skip

    in_seq = offs_m < T
    o_rows = Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_rows, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=in_seq[:, None])
    tl.store(LSE + bh * T + offs_m, m_i + tl.math.log2(l_i), mask=in_seq)
