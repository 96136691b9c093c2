"""The Triton kernel behind :func:`llm.precision.fp8.triton_gemm.fp8_blockwise_mm`.

Imports triton at the top: triton_gemm.py imports this module only when the kernel is
called, so the repo imports without triton. CPU tensors run in Triton's interpreter when
TRITON_INTERPRET=1 was set before triton was imported (tests only).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# K elements per scale: DeepSeek-V3's tile width, its promotion interval N_C.
from llm.precision.fp8.scaling import TILE as CHUNK

# (BLOCK_M, BLOCK_N) under the interpreter: small, so that ragged M and N cross block edges
# and several N blocks share one 128-row weight block; timing means nothing there.
INTERPRETER_BLOCKS = (32, 16)


def _configs():
    """Around the fp8 configurations of Triton's own matmul tutorials for H100: a stage holds
    a (BLOCK_M, 128) and a (128, BLOCK_N) fp8 tile, 32 KiB at 128x128, so four stages fit."""
    rows = [(128, 128, 8, 4), (128, 128, 4, 3), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 5)]
    gpu = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in rows
    ]
    m, n = INTERPRETER_BLOCKS
    return [*gpu, triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=1, num_stages=1)]


def _prune(configs, named_args, **kwargs):
    """The interpreter's one configuration under the interpreter, the GPU's list on a GPU."""
    interpreted = triton.knobs.runtime.interpret
    return [c for c in configs if (c.num_warps == 1) == interpreted]


def _untimed(kernel_call, quantiles):
    return [0.0] * len(quantiles)


@triton.autotune(
    configs=_configs(),
    key=["M", "N", "K", "B_BLOCKS"],
    prune_configs_by={"early_config_prune": _prune},
    # Under the interpreter nothing is timed (the one configuration left needs no choice).
    do_bench=_untimed if triton.knobs.runtime.interpret else None,
)
@triton.jit
def fp8_blockwise_kernel(
    A,
    B,
    C,
    A_SCALE,
    B_SCALE,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    B_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),). A (M, K), B (N, K) fp8, any strides;
    A_SCALE (M, K / CHUNK) fp32; B_SCALE (cdiv(N, CHUNK), K / CHUNK) when B_BLOCKS, else
    (N, K / CHUNK); C (M, N) = dequant(A) @ dequant(B)^T. K is a multiple of CHUNK."""
    # GROUP_M row blocks take their column blocks in turn, so B's tiles are re-read from L2.
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * blocks_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    # int64 offsets: a row index times a stride can pass 2**31 elements.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, CHUNK).to(tl.int64)
    in_m = offs_m < M
    in_n = offs_n < N
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, CHUNK)
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (CHUNK, BLOCK_N)
    a_scale_ptrs = A_SCALE + offs_m * stride_asm
    if B_BLOCKS:
        b_scale_ptrs = B_SCALE + (offs_n // CHUNK) * stride_bsn  # 128 rows of B share a scale
    else:
        b_scale_ptrs = B_SCALE + offs_n * stride_bsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for chunk in range(0, K // CHUNK):
        a = tl.load(a_ptrs, mask=in_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=in_n[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + chunk * stride_ask, mask=in_m, other=0.0)
        b_scale = tl.load(b_scale_ptrs + chunk * stride_bsk, mask=in_n, other=0.0)
        # A fresh dot per chunk, promoted here into the fp32 accumulator with the chunk's
        # scales (DeepSeek-V3 §3.3.2): on sm_90 Triton lets an fp8 dot accumulate inside
        # the tensor core, whose adder keeps about 14 bits, so one dot carrying ``acc``
        # over all of K would lose precision as K grows; 128 products at a time do not.
        partial = tl.dot(a, b)  # (BLOCK_M, BLOCK_N) fp32, code products summed
        acc += partial * (a_scale[:, None] * b_scale[None, :])
        a_ptrs += CHUNK * stride_ak
        b_ptrs += CHUNK * stride_bk

    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def launch(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, b_blocks: bool, out: Tensor
) -> Tensor:
    """Runs the kernel on checked operands (see fp8_blockwise_mm) into ``out`` (M, N)."""
    (m, k), n = a.shape, b.size(0)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    fp8_blockwise_kernel[grid](
        a, b, out, a_scale, b_scale, m, n, k,
        *a.stride(), *b.stride(), *out.stride(), *a_scale.stride(), *b_scale.stride(),
        B_BLOCKS=b_blocks, GROUP_M=8, CHUNK=CHUNK,
    )  # fmt: skip
    return out


def tuned_configs() -> list[dict]:
    """The configuration the autotuner kept per key (M, N, K, B_BLOCKS) in this process."""
    return [
        {"key": key, **config.kwargs, "num_warps": config.num_warps}
        for key, config in fp8_blockwise_kernel.cache.items()
    ]
