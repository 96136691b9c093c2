"""DeepSeek-V3's fine-grained fp8 GEMM in Triton: fp8 codes times fp32 scales per 1x128 tile
(activations, their gradients) and per 128x128 block (weights), as DeepGEMM does it.

Each 128-wide chunk of K is one tl.dot of fp8 codes; its fp32 result is multiplied by the
chunk's scales and added to an fp32 accumulator (DeepSeek-V3 §3.3.2, promotion every
N_C = 128 elements). The kernel is in triton_gemm_kernel.py, imported on first call, so the
repo imports without triton. The three GEMMs of an fp8 linear, x (M, K) tokens by
in_features, w (N, K), g = grad_output (M, N), in the recipe's quantisers (scaling.py):

    output (M, N) = x @ w^T
        xq = quantize_tiles(x, dim=1); wq = quantize_blocks(w)
        fp8_blockwise_mm(xq.data, xq.scale, wq.data, wq.scale, b_blocks=True)
    grad_input (M, K) = g @ w                        reduces over N; w's blocks serve as they are
        gq = quantize_tiles(g, dim=1)
        fp8_blockwise_mm(gq.data, gq.scale, wq.data.t(), wq.scale.t(), b_blocks=True)
    grad_weight (N, K) = g^T @ x                     reduces over the tokens, padded to M_pad,
        gt = quantize_tiles(g_pad, dim=0)            a multiple of 128, with zero rows
        xt = quantize_tiles(x_pad, dim=0)
        fp8_blockwise_mm(gt.data.t(), gt.scale.t(), xt.data.t(), xt.scale.t(), b_blocks=False)

The ``.t()`` views are taken as they are (no copy); operands whose K is not their contiguous
dimension are slower to load on a GPU than K-major ones (DeepGEMM takes K-major only).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.precision.fp8.scaling import TILE  # K elements per scale

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper: the first with fp8 (e4m3) tensor cores
_INSTALL = "pip install -c constraints.txt triton==3.9.0"
_KERNEL = "llm.precision.fp8.triton_gemm_kernel"


def fp8_gemm_unavailable(device: torch.device | str) -> str | None:
    """None if the kernel can run on ``device`` here, else one line: why not, and the fix.
    CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
    imported; correctness tests only)."""
    try:
        import triton
    except ImportError:
        return f"the fp8 Triton GEMM needs the triton package: {_INSTALL}"
    device = torch.device(device)
    if device.type == "cpu" and triton.knobs.runtime.interpret:
        return None
    if device.type != "cuda":
        return (
            f"the fp8 Triton GEMM needs CUDA tensors, not {device} (on CPU it runs only in "
            "Triton's interpreter: TRITON_INTERPRET=1 set before triton is imported; tests only)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return (
            f"the fp8 Triton GEMM needs compute capability {need}+ for e4m3 tensor cores (this "
            f"GPU has {capability[0]}.{capability[1]}); use the emulated fp8 GEMMs"
        )
    return None


# Under torch.compile the kernel runs as it is, outside the graph (as our FlashAttention).
@torch.compiler.disable
def fp8_blockwise_mm(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    *,
    b_blocks: bool,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(M, N) = dequant(a) @ dequant(b)^T in ``out_dtype``, accumulated in fp32.

    a: (M, K) float8_e4m3fn codes, any strides; a_scale: (M, K / 128) fp32, the dequantising
    multiplier of each 1x128 tile of a row (``Quantized.scale``: a ≈ code * scale).
    b: (N, K) float8_e4m3fn codes, any strides; b_scale: (ceil(N / 128), K / 128) fp32 when
    ``b_blocks`` (128x128 blocks: a weight), else (N, K / 128) (1x128 tiles per row).
    ``b_blocks`` is asked for, not read from b_scale's shape: with N = 1 both shapes are
    (1, K / 128), and a shape that fits the other granularity is refused, not reinterpreted.
    K must be a multiple of 128; M and N are free (ragged edges are masked).
    """
    _check(a, a_scale, b, b_scale, b_blocks, out_dtype)
    m, n = a.size(0), b.size(0)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if why := fp8_gemm_unavailable(a.device):
        raise ConfigError(why)
    return importlib.import_module(_KERNEL).launch(a, a_scale, b, b_scale, b_blocks, out)


def _check(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, b_blocks: bool, out_dtype
) -> None:
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ConfigError(
            f"fp8_blockwise_mm takes float8_e4m3fn codes for a and b, got {a.dtype} and "
            f"{b.dtype}; quantise them first (llm.precision.fp8.scaling.quantize_tiles/_blocks)"
        )
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(1):
        raise ConfigError(
            f"fp8_blockwise_mm wants a (M, K) and b (N, K) with the same K; got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    (m, k), n = a.shape, b.size(0)
    if k == 0 or k % TILE:
        raise ConfigError(
            f"fp8_blockwise_mm needs K (the reduction dimension) a positive multiple of {TILE}, "
            f"got {k}; pad the operands with zeros along K"
        )
    b_kind, b_rows = ("128x128 blocks", -(-n // TILE)) if b_blocks else ("1x128 tiles", n)
    for name, scale, of, kind, want in (
        ("a_scale", a_scale, a, "1x128 tiles", (m, k // TILE)),
        ("b_scale", b_scale, b, b_kind, (b_rows, k // TILE)),
    ):
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ConfigError(
                f"fp8_blockwise_mm: {name} ({kind} of a {tuple(of.shape)} operand) must be "
                f"float32 of shape {want}, got {scale.dtype} {tuple(scale.shape)}"
            )
    devices = {t.device for t in (a, a_scale, b, b_scale)}
    if len(devices) > 1:
        raise ConfigError(
            f"fp8_blockwise_mm: a, a_scale, b and b_scale must be on one device, got "
            f"{sorted(map(str, devices))}"
        )
    if out_dtype not in OUT_DTYPES:
        raise ConfigError(
            f"fp8_blockwise_mm writes {[str(d) for d in OUT_DTYPES]}, not {out_dtype}"
        )
