"""fp8 training recipes: quantise each GEMM operand as a recipe does, then either dequantise
and multiply in fp32 (emulation: the recipes' rounding exactly on any device, CPU included,
not their speed) or, for deepseek on a GPU, multiply the codes on our Triton GEMM.

- scaling.py: the quantisers (tensorwise, rowwise, 1x128 tiles, 128x128 blocks; e4m3/e5m2,
  saturating) with each source's scale arithmetic (torchao's, DeepSeek-V3's).
- linear.py: the recipes (tensorwise, rowwise, deepseek), :class:`Fp8Linear` and its
  autograd function doing the three GEMMs on fp8 operands; :func:`record_fp8_stats`.
- triton_gemm.py (kernel in triton_gemm_kernel.py): the block-scaled fp8 GEMM.
- stats.py: the opt-in quantisation error, saturation and underflow record, per layer and
  operand.
- convert.py: :func:`convert_to_fp8`, which swaps the blocks' linears in place.
"""

from llm.precision.fp8.convert import FP8_LINEAR_NAMES, convert_to_fp8
from llm.precision.fp8.linear import RECIPES, Fp8Linear, Fp8Recipe, get_recipe, record_fp8_stats
from llm.precision.fp8.scaling import (
    DEEPSEEK_RULE,
    E4M3,
    E5M2,
    TILE,
    TORCHAO_POW2_RULE,
    TORCHAO_RULE,
    Quantized,
    ScaleRule,
    overflow_threshold,
    quantize,
    quantize_blocks,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tiles,
    quantize_with_factor,
)
from llm.precision.fp8.stats import Fp8Stats

__all__ = [
    "DEEPSEEK_RULE",
    "E4M3",
    "E5M2",
    "FP8_LINEAR_NAMES",
    "RECIPES",
    "TILE",
    "TORCHAO_POW2_RULE",
    "TORCHAO_RULE",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8Stats",
    "Quantized",
    "ScaleRule",
    "convert_to_fp8",
    "get_recipe",
    "overflow_threshold",
    "quantize",
    "quantize_blocks",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_tiles",
    "quantize_with_factor",
    "record_fp8_stats",
]
