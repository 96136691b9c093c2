"""DeepSeek-V3's block-scaled fp8 GEMM (1x128 activation tiles x 128x128 weight blocks) at
llama-1b's linear shapes: our Triton kernel (llm/precision/fp8/triton_gemm.py) against its
peer in torch, ``torch.nn.functional.scaled_mm`` with ScalingType.BlockWise1x128 and
BlockWise128x128 (cuBLASLt, sm90, CUDA 12.9+), and a bf16 matmul of the same shape. Each
fp8 product is checked against the emulated GEMM (dequantised operands, fp32 matmul):
``max_rel_diff`` is the largest |difference| over the largest |emulated| value.

Elsewhere (no GPU with fp8 tensor cores) the rows are the emulated GEMM's only, and the
notes say why the kernels did not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_pass.common import Result, device
from benchmarks.timing import median_ms
from llm.precision.fp8.scaling import quantize_blocks, quantize_tiles
from llm.precision.fp8.triton_gemm import fp8_blockwise_mm, fp8_gemm_unavailable

# (name, tokens, in_features, out_features): llama-1b's wq, w1 (and w3), w2 at 8 x 2048 tokens.
GPU = [("wq", 16384, 2048, 2048), ("w1", 16384, 2048, 8192), ("w2", 16384, 8192, 2048)]
DRY = [("wq", 256, 128, 128), ("w1", 256, 128, 384)]


def _scaled_mm(xq, wq) -> torch.Tensor:
    """torch's blockwise scaled_mm: cuBLASLt wants the tile scales token-major (M, K/128)
    with M a multiple of 4, and the weight's K blocks padded to a multiple of 4."""
    m, kb = xq.data.size(0), xq.factor.size(1)
    a, a_scale = xq.data, xq.scale
    if m % 4:
        a, a_scale = (
            F.pad(a.view(torch.uint8), (0, 0, 0, -m % 4)).view(a.dtype),
            F.pad(a_scale, (0, 0, 0, -m % 4)),
        )
    b_scale = F.pad(wq.scale, (0, -kb % 4)) if kb % 4 else wq.scale
    return F.scaled_mm(
        a,
        wq.data.t(),
        a_scale.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        b_scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )[:m]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _row(shape: tuple, dev, why: str | None, min_time: float, notes: list[str]) -> dict:
    name, m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dev)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    xq, wq = quantize_tiles(x, dim=1), quantize_blocks(w)
    xb, wb = x.bfloat16(), w.bfloat16()

    def emulated() -> torch.Tensor:
        return xq.dequantize() @ wq.dequantize().t()

    def ours() -> torch.Tensor:
        return fp8_blockwise_mm(
            xq.data, xq.scale, wq.data, wq.scale, b_blocks=True, out_dtype=torch.bfloat16
        )

    row = {
        "linear": name, "shape": f"{m}x{k} @ {k}x{n}",
        "emulated_ms": median_ms(emulated, warmup=1, min_run_time=min_time),
        "bf16_ms": median_ms(lambda: xb @ wb.t(), warmup=2, min_run_time=min_time),
    }  # fmt: skip
    if not why:
        reference = emulated()
        row["ours_ms"] = median_ms(ours, warmup=3, min_run_time=min_time)
        row["ours_max_rel_diff"] = _rel(ours(), reference)
        try:
            row["torch_max_rel_diff"] = _rel(_scaled_mm(xq, wq), reference)
            row["torch_ms"] = median_ms(lambda: _scaled_mm(xq, wq), warmup=3, min_run_time=min_time)
        except (RuntimeError, AttributeError) as e:  # cuBLAS or torch without the recipe
            notes.append(f"{name}: torch's blockwise scaled_mm not run: {str(e).splitlines()[0]}")
    for key in ("ours", "torch", "bf16"):
        if f"{key}_ms" in row:
            row[f"{key}_tflops"] = 2 * m * k * n / row[f"{key}_ms"] / 1e9
    return row


def run(dry: bool) -> Result:
    dev = device(dry)
    shapes, min_time = (DRY, 0.05) if dry else (GPU, 0.3)
    why = fp8_gemm_unavailable(dev)  # CUDA with fp8 tensor cores (sm89+), and triton
    notes = [f"ours and torch's scaled_mm not run: {why}"] if why else []
    rows = [_row(shape, dev, why, min_time, notes) for shape in shapes]
    return Result(
        title="DeepSeek's block-scaled fp8 GEMM: ours (Triton) against torch's scaled_mm and bf16",
        shapes="tiny" if dry else "llama-1b's linears at 8 x 2048 tokens, bf16 output",
        columns=["linear", "shape", "ours_ms", "torch_ms", "bf16_ms", "emulated_ms",
                 "ours_tflops", "torch_tflops", "bf16_tflops", "ours_max_rel_diff",
                 "torch_max_rel_diff"],
        rows=rows,
        notes=notes,
    )  # fmt: skip
