"""Runs our fp8 blockwise GEMM in Triton's interpreter on CPU, for test_fp8_triton.py.

Triton decides compiled or interpreted when it is imported, so TRITON_INTERPRET=1 must be set
before the import and must not reach the other tests of the pytest process; the test runs
``TRITON_INTERPRET=1 python tests/fp8_triton_cases.py OUT.pt`` in a subprocess, which saves
the kernel's output for every case, and compares them in-process. ``operands`` builds each
case's fp8 operands with the recipe's own quantisers, as Fp8Linear's three GEMMs take them,
the same in every process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from llm.precision.fp8.scaling import TILE, quantize_blocks, quantize_tiles

LAYOUTS = ("output", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Case:
    """One GEMM of an fp8 linear with ``tokens`` rows of input, weight (out_f, in_f)."""

    layout: str  # output = x @ w^T, grad_input = g @ w, grad_weight = g^T @ x
    tokens: int
    out_f: int
    in_f: int
    column_major: bool = False  # output: x and w stored transposed, passed as .t() views
    outlier: bool = False  # one tile of a 1e4 times larger, one all zero
    chunk_factors: tuple[float, ...] = ()  # a's and b's K chunks scaled by these, in turn
    out_dtype: torch.dtype = torch.float32


# Names give the GEMM's M, N, K (grad_weight: K = tokens padded to 128). Interpreter blocks
# are BLOCK_M=32, BLOCK_N=16: 1, 100 and 300 leave ragged edges, and eight N blocks share
# each 128-row weight block.
CASES = {
    "output_M1_N128_K128": Case("output", 1, 128, 128),
    "output_M100_N300_K384_outlier": Case("output", 100, 300, 384, outlier=True),
    "output_M300_N100_K128_column_major": Case("output", 300, 100, 128, column_major=True),
    "output_chunk_scales_differ": Case("output", 40, 100, 384, chunk_factors=(1e-3, 1.0, 1e3)),
    "output_bf16": Case("output", 100, 128, 256, out_dtype=torch.bfloat16),
    "grad_input_M100_N300_K128": Case("grad_input", 100, 128, 300),
    "grad_input_M1_N100_K384_outlier": Case("grad_input", 1, 384, 100, outlier=True),
    "grad_input_chunk_scales_differ": Case("grad_input", 30, 384, 40, chunk_factors=(1e3, 1e-2, 1.0)),
    "grad_weight_M100_N300_K384_outlier": Case("grad_weight", 300, 100, 300, outlier=True),
    "grad_weight_M1_N128_K128": Case("grad_weight", 100, 1, 128),
    "grad_weight_M128_N1_K128_fp16": Case("grad_weight", 100, 128, 1, out_dtype=torch.float16),
}  # fmt: skip


def _ceil(n: int) -> int:
    return -(-n // TILE) * TILE


def operands(case: Case, device: str = "cpu", seed: int = 0) -> dict:
    """The kernel's arguments a, a_scale, b, b_scale, b_blocks for ``case``, and ``emulated``:
    the same GEMM as linear.py does it today, on the dequantised operands in fp32. Drawn on
    CPU, quantised on ``device``, where the views are taken (a copy would lose their strides)."""
    g_ = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.in_f, generator=g_)
    g = torch.randn(case.tokens, case.out_f, generator=g_)
    # quantize_blocks needs both sides multiples of 128: a ragged weight is a slice of one.
    w_full = torch.randn(_ceil(case.out_f), _ceil(case.in_f), generator=g_) * 0.05
    if case.layout == "grad_weight":  # tokens padded with zero rows, as _token_operand does
        pad = _ceil(case.tokens) - case.tokens
        x, g = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (x, g))
    # a's and b's sources seen as (M, K) and (N, K): the edits below are made through them.
    a_src, b_src = {
        "output": (x, w_full),
        "grad_input": (g, w_full.t()),
        "grad_weight": (g.t(), x.t()),
    }[case.layout]
    k = a_src.size(1)
    if case.outlier:
        a_src[0, :TILE] *= 1e4
        a_src[-1, k - TILE :] = 0.0
    for c, factor in enumerate(case.chunk_factors):
        a_src[:, c * TILE : (c + 1) * TILE] *= factor
        b_src[:, c * TILE : (c + 1) * TILE] *= factor
    x, g, w_full = (t.to(device) for t in (x, g, w_full))

    out_f, in_f = case.out_f, case.in_f
    if case.layout == "output":
        xq, wq = quantize_tiles(x, dim=1), quantize_blocks(w_full[:, :in_f])
        a, b = xq.data, wq.data[:out_f]
        if case.column_major:
            a, b = (t.t().contiguous().t() for t in (a, b))
        args = {"a": a, "a_scale": xq.scale, "b": b, "b_scale": wq.scale, "b_blocks": True}
        emulated = xq.dequantize() @ wq.dequantize()[:out_f].t()
    elif case.layout == "grad_input":
        gq, wq = quantize_tiles(g, dim=1), quantize_blocks(w_full[:out_f])
        args = {
            "a": gq.data, "a_scale": gq.scale,
            "b": wq.data[:, :in_f].t(), "b_scale": wq.scale.t(), "b_blocks": True,
        }  # fmt: skip
        emulated = gq.dequantize() @ wq.dequantize()[:, :in_f]
    else:
        gt, xt = quantize_tiles(g, dim=0), quantize_tiles(x, dim=0)
        args = {
            "a": gt.data.t(), "a_scale": gt.scale.t(),
            "b": xt.data.t(), "b_scale": xt.scale.t(), "b_blocks": False,
        }  # fmt: skip
        emulated = gt.dequantize().t() @ xt.dequantize()
    return {**args, "emulated": emulated}


def run_case(case: Case) -> torch.Tensor:
    from llm.precision.fp8.triton_gemm import fp8_blockwise_mm

    x = operands(case)
    return fp8_blockwise_mm(
        x["a"], x["a_scale"], x["b"], x["b_scale"], b_blocks=x["b_blocks"], out_dtype=case.out_dtype
    )


def linear_inputs() -> tuple[torch.nn.Linear, torch.Tensor]:
    """An nn.Linear (256 -> 384, bias) and 100 tokens of input: ragged against every tile."""
    torch.manual_seed(7)
    return torch.nn.Linear(256, 384), torch.randn(100, 256)


def run_linear(kernel: bool) -> dict:
    """Fp8Linear (deepseek) forward and backward, its GEMMs on the kernel or emulated: the
    output, the three gradients and what record_fp8_stats saw."""
    from llm.precision.fp8 import Fp8Linear, record_fp8_stats

    linear, x = linear_inputs()
    fp8 = torch.nn.Sequential(Fp8Linear.from_linear(linear, "deepseek", kernel=kernel))
    x.requires_grad_(True)
    with record_fp8_stats(fp8) as stats:
        out = fp8(x)
        out.square().sum().backward()
    return {
        "output": out.detach(),
        "grad_input": x.grad,
        "grad_weight": linear.weight.grad,
        "grad_bias": linear.bias.grad,
        "stats": stats.summary(),
    }


def main(path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    from llm.precision.fp8.triton_gemm_kernel import tuned_configs

    results = {name: run_case(case) for name, case in CASES.items()}
    linear = run_linear(kernel=True)
    torch.save({"cases": results, "tuned": tuned_configs(), "linear": linear}, path)


if __name__ == "__main__":
    main(sys.argv[1])
