"""fp8 quantisers of the three training recipes, emulated exactly on any device (CPU included).

A tensor is cut into groups (the whole tensor, a row, a 1x128 tile, a 128x128 block); each
group gets one fp32 scale from its absolute maximum (amax), its values are divided by that
scale, clamped to the format's maximum (saturation: nothing becomes inf or NaN) and cast with
torch's own round-to-nearest-even cast. Each source's arithmetic is kept, since it decides the
rounding of the codes:

- DeepSeek-V3 (inference/kernel.py's act_quant, §3.3 of arXiv:2412.19437): amax floored at
  1e-4, s = amax / 448 in fp32, codes = x / s, x ≈ codes * s. Scales are not rounded to a
  power of two (its optional ue8m0 scale format is not what the paper's training describes).
- torchao (float8_utils.amax_to_scale, Float8TrainingTensor): r = 448 / max(amax, 1e-12)
  computed in float64 then cast to fp32, codes = x * r, x ≈ codes / r; its rowwise recipe
  rounds r down to a power of two (round_scales_to_power_of_2=True), tensorwise does not.

:attr:`Quantized.scale` is always the dequantisation multiplier (x ≈ data * scale), whichever
of the two a source stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from llm.errors import ConfigError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
TILE = 128  # DeepSeek-V3's tile width and block side


@dataclass(frozen=True)
class ScaleRule:
    """How a source turns a group's amax into a scale and applies it."""

    amax_floor: float  # an all-zero group still gets a finite scale
    reciprocal: bool  # torchao stores r = fmax / amax and multiplies; DeepSeek stores s and divides
    power_of_2: bool = False  # round r down to a power of two (torchao's rowwise; needs reciprocal)


DEEPSEEK_RULE = ScaleRule(amax_floor=1e-4, reciprocal=False)
TORCHAO_RULE = ScaleRule(amax_floor=1e-12, reciprocal=True)
TORCHAO_POW2_RULE = ScaleRule(amax_floor=1e-12, reciprocal=True, power_of_2=True)


@dataclass(frozen=True)
class Quantized:
    """``data`` (fp8, the source's shape) with one fp32 ``factor`` per group of ``group``
    elements (factor shape = source shape // group): s for DeepSeek's rule, r = 1/s for
    torchao's. ``saturated``: how many elements a non-saturating cast would have turned into
    inf or NaN (the clamp caught them)."""

    data: Tensor
    factor: Tensor
    group: tuple[int, ...]
    rule: ScaleRule
    saturated: Tensor  # int64 ()

    @property
    def scale(self) -> Tensor:
        """The dequantisation multiplier of each group: x ≈ data * scale."""
        return self.factor.reciprocal() if self.rule.reciprocal else self.factor

    def dequantize(self) -> Tensor:
        return dequantize(self.data, self.factor, self.group, self.rule)


def dequantize(data: Tensor, factor: Tensor, group: tuple[int, ...], rule: ScaleRule) -> Tensor:
    """fp32 values the codes ``data`` stand for, in its shape, as the source computes them."""
    codes = _grouped(data.float(), group)
    factor = factor.reshape(_factor_view(tuple(factor.shape)))
    values = codes / factor if rule.reciprocal else codes * factor
    return values.reshape(data.shape)


def overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude a round-to-nearest cast would take past the format's maximum
    (half an ulp above it): 464 for e4m3 (max 448), 61440 for e5m2 (max 57344)."""
    info = torch.finfo(dtype)
    ulp = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return info.max + ulp / 2


def quantize(x: Tensor, group: tuple[int, ...], rule: ScaleRule, dtype: torch.dtype) -> Quantized:
    """One scale per ``group``-shaped block of ``x``; every dimension a multiple of its group."""
    for dim, (size, g) in enumerate(zip(x.shape, group, strict=True)):
        if size % g:
            raise ConfigError(
                f"fp8 quantisation in groups of {tuple(group)} needs dim {dim} of a tensor of "
                f"shape {tuple(x.shape)} to be a multiple of {g}; use model shapes whose "
                f"linear in/out features are multiples of {TILE} (e.g. d_model 128)"
            )
    grouped = _grouped(x.float(), group)  # (n0, g0, n1, g1, ...)
    amax = grouped.abs().amax(dim=tuple(range(1, grouped.dim(), 2)), keepdim=True)
    factor = _factor(amax, rule, torch.finfo(dtype).max)
    return quantize_with_factor(x, factor.reshape(_n_groups(x, group)), group, rule, dtype)


def quantize_with_factor(
    x: Tensor, factor: Tensor, group: tuple[int, ...], rule: ScaleRule, dtype: torch.dtype
) -> Quantized:
    """``x`` cast with given per-group factors (shape = x's shape // group; s, or r under a
    reciprocal rule). Scales from the tensor's own amax never push a value past the maximum;
    scales from elsewhere (an older step's amax, as delayed scaling uses) can, and those
    values saturate to the maximum."""
    fmax = torch.finfo(dtype).max
    grouped = _grouped(x.float(), group)
    factor = factor.float().reshape(_factor_view(_n_groups(x, group)))
    scaled = grouped * factor if rule.reciprocal else grouped / factor
    saturated = (scaled.abs() >= overflow_threshold(dtype)).sum()
    data = scaled.clamp(-fmax, fmax).to(dtype).reshape(x.shape)
    return Quantized(data, factor.reshape(_n_groups(x, group)), tuple(group), rule, saturated)


def quantize_tensorwise(
    x: Tensor, rule: ScaleRule = TORCHAO_RULE, dtype: torch.dtype = E4M3
) -> Quantized:
    """One scale for the whole tensor (torchao's tensorwise recipe)."""
    return quantize(x, tuple(x.shape), rule, dtype)


def quantize_rowwise(
    x: Tensor, dim: int, rule: ScaleRule = TORCHAO_POW2_RULE, dtype: torch.dtype = E4M3
) -> Quantized:
    """One scale per slice along ``dim`` (torchao's axiswise): the amax runs over ``dim``,
    the reduction dimension of the GEMM ``x`` enters, so each scale factors out of a dot
    product."""
    return quantize(x, _along(x, dim, x.shape[dim]), rule, dtype)


def quantize_tiles(
    x: Tensor, dim: int, rule: ScaleRule = DEEPSEEK_RULE, dtype: torch.dtype = E4M3
) -> Quantized:
    """One scale per 128 consecutive elements along ``dim`` (DeepSeek-V3's 1x128 tiles of
    activations and their gradients, laid along the GEMM's reduction dimension)."""
    return quantize(x, _along(x, dim, TILE), rule, dtype)


def quantize_blocks(
    x: Tensor, rule: ScaleRule = DEEPSEEK_RULE, dtype: torch.dtype = E4M3
) -> Quantized:
    """One scale per 128x128 block of a 2-D weight (DeepSeek-V3): the same blocks serve the
    forward GEMM (reducing over columns) and the input-gradient GEMM (over rows)."""
    if x.dim() != 2:
        raise ConfigError(
            f"128x128 block quantisation takes a 2-D weight, got shape {tuple(x.shape)}"
        )
    return quantize(x, (TILE, TILE), rule, dtype)


def _along(x: Tensor, dim: int, size: int) -> tuple[int, ...]:
    group = [1] * x.dim()
    group[dim] = size
    return tuple(group)


def _grouped(x: Tensor, group: tuple[int, ...]) -> Tensor:
    """(s0, s1, ...) -> (s0/g0, g0, s1/g1, g1, ...): each group spans the odd dimensions."""
    shape = [n for size, g in zip(x.shape, group, strict=True) for n in (size // g, g)]
    return x.reshape(shape)


def _n_groups(x: Tensor, group: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size // g for size, g in zip(x.shape, group, strict=True))


def _factor_view(n_groups: tuple[int, ...]) -> list[int]:
    """(n0, n1, ...) -> (n0, 1, n1, 1, ...): one factor broadcast over its group."""
    return [n for size in n_groups for n in (size, 1)]


def _factor(amax: Tensor, rule: ScaleRule, fmax: float) -> Tensor:
    if not rule.reciprocal:
        return amax.clamp(min=rule.amax_floor) / fmax  # act_quant: s = max(amax, 1e-4) / 448
    # torchao's amax_to_scale: float64, so eager and compiled code give the same fp32 scale.
    r = (fmax / amax.double().clamp(min=rule.amax_floor)).float()
    return torch.exp2(torch.floor(torch.log2(r))) if rule.power_of_2 else r
