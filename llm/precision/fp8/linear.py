"""An nn.Linear whose three GEMMs take fp8 operands cast per recipe. Emulated: each operand
is quantised with the recipe's scales, dequantised to fp32, and multiplied in fp32. With
``kernel`` (deepseek): the same codes and scales go to our Triton GEMM (triton_gemm.py),
which multiplies fp8 codes on tensor cores and promotes every 128-wide chunk of K to fp32.

    output      (M, N) = input (M, K) @ weight (N, K)^T           reduces over K = in_features
    grad_input  (M, K) = grad_output (M, N) @ weight (N, K)       reduces over N = out_features
    grad_weight (N, K) = grad_output (M, N)^T @ input (M, K)      reduces over M = tokens

Every scale is taken along the reduction dimension of the GEMM its operand enters, so it
factors out of each dot product (DeepSeek-V3 §3.3.2: "per-group scaling factors along the
inner dimension"). The codes and scales are the recipe's to the bit (scaling.py); the GEMM
differs from the hardware's only by fp32 rounding. DeepSeek's kernels (and ours) multiply
fp8 codes on tensor cores whose accumulator keeps about 14 bits, so they promote the partial
sum of each 128 elements of K to fp32 registers, scaled there (§3.3.2, N_C = 128). In the
emulation every product and every sum is fp32 already, which is what that promotion buys;
summing 128-wide chunks
explicitly would only reorder fp32 additions (a difference near 2^-24 relative, against the
2^-4 of an e4m3 code), so one fp32 matmul stands for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.errors import ConfigError
from llm.precision.fp8.scaling import (
    DEEPSEEK_RULE,
    E4M3,
    E5M2,
    TILE,
    TORCHAO_POW2_RULE,
    TORCHAO_RULE,
    Quantized,
    ScaleRule,
    dequantize,
    quantize_blocks,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tiles,
)
from llm.precision.fp8.stats import Fp8Stats, LayerStats
from llm.precision.fp8.triton_gemm import fp8_blockwise_mm


@dataclass(frozen=True)
class Fp8Recipe:
    """Which scales each GEMM operand gets: ``activations`` for inputs and output gradients
    ("tensor", "row" or "tile"), ``weights`` ("tensor", "row" or "block"), each along the
    GEMM's reduction dimension; output gradients in ``grad_dtype``, the rest in e4m3."""

    name: str
    activations: str
    weights: str
    rule: ScaleRule
    grad_dtype: torch.dtype
    # DeepSeek keeps the fp8 forward copies: the weight's 128x128 blocks serve grad_input
    # as they are, and the input's 1x128 tiles are dequantised, transposed and requantised
    # into 128x1 tiles for grad_weight (§3.5.2). torchao casts the saved high-precision
    # input and weight afresh for each GEMM.
    from_fp8_copies: bool

    def cast(self, t: Tensor, granularity: str, dim: int, dtype: torch.dtype = E4M3) -> Quantized:
        """``t`` cast with one scale per ``granularity`` group, the groups along ``dim``."""
        if granularity == "tensor":
            return quantize_tensorwise(t, self.rule, dtype)
        if granularity == "row":
            return quantize_rowwise(t, dim, self.rule, dtype)
        if granularity == "tile":
            return quantize_tiles(t, dim, self.rule, dtype)
        return quantize_blocks(t, self.rule, dtype)


RECIPES = {
    # torchao's default Float8LinearConfig: one dynamic scale per tensor; grad_output in
    # e5m2 (its default for gradients), input and weight in e4m3; scales not rounded.
    "tensorwise": Fp8Recipe("tensorwise", "tensor", "tensor", TORCHAO_RULE, E5M2, False),
    # torchao's "rowwise": axiswise scales, e4m3 for all three, scales rounded down to 2^k.
    "rowwise": Fp8Recipe("rowwise", "row", "row", TORCHAO_POW2_RULE, E4M3, False),
    # DeepSeek-V3 §3.3: 1x128 tiles for activations and their gradients, 128x128 blocks
    # for weights, e4m3 everywhere.
    "deepseek": Fp8Recipe("deepseek", "tile", "block", DEEPSEEK_RULE, E4M3, True),
}


def get_recipe(name: str) -> Fp8Recipe:
    if name not in RECIPES:
        raise ConfigError(
            f"precision.fp8_recipe={name!r} is unknown; choose one of {', '.join(RECIPES)}"
        )
    return RECIPES[name]


class _Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T -> (M, N) fp32, each of the three GEMMs on fp8 operands:
    emulated, or (``kernel``, deepseek only) the codes and scales multiplied by our Triton
    GEMM (triton_gemm.py)."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        recipe: Fp8Recipe,
        stats: LayerStats | None,
        kernel: bool,
    ):
        xq = recipe.cast(x, recipe.activations, dim=1)
        wq = recipe.cast(weight, recipe.weights, dim=1)
        if stats is not None:
            stats.record("input", x, xq)
            stats.record("weight", weight, wq)
        if recipe.from_fp8_copies:
            # The fp8 codes and their fp32 scales are what backward keeps: 1 + 4/128 bytes an
            # element instead of the 16-bit input's 2 (and a 1-byte copy of the weight).
            ctx.save_for_backward(xq.data, xq.factor, wq.data, wq.factor)
            ctx.groups = (xq.group, wq.group)
        else:
            ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.stats, ctx.dtypes = recipe, stats, (x.dtype, weight.dtype)
        ctx.kernel = kernel
        if kernel:
            return fp8_blockwise_mm(xq.data, xq.scale, wq.data, wq.scale, b_blocks=True)
        return xq.dequantize() @ wq.dequantize().t()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        recipe, stats = ctx.recipe, ctx.stats
        grad_out = grad_out.float()  # (M, N)
        if ctx.kernel:
            return (*_kernel_backward(ctx, grad_out), None, None, None)
        x_saved, w_saved = _saved_operands(ctx)
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                gq = recipe.cast(grad_out, recipe.activations, dim=1, dtype=recipe.grad_dtype)
                if recipe.from_fp8_copies:
                    w_t = w_saved  # the forward's 128x128 blocks, dequantised
                else:
                    w_t = _weight_for_grad_input(recipe, stats, w_saved)
                if stats is not None:
                    stats.record("grad_output", grad_out, gq)
                grad_x = (gq.dequantize() @ w_t).to(ctx.dtypes[0])
            if ctx.needs_input_grad[1]:
                g_t = _token_operand(recipe, stats, "grad_output_t", grad_out, recipe.grad_dtype)
                x_t = _token_operand(recipe, stats, "input_t", x_saved, E4M3)
                grad_w = (g_t.t() @ x_t).to(ctx.dtypes[1])
        return grad_x, grad_w, None, None, None


def _kernel_backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """DeepSeek's backward GEMMs on the Triton kernel, from the forward's fp8 copies: the
    weight's 128x128 blocks as they are (transposed views) for grad_input; the input's 1x128
    tiles dequantised and requantised along the tokens for grad_weight."""
    recipe, stats = ctx.recipe, ctx.stats
    x_data, x_factor, w_data, w_factor = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        gq = recipe.cast(grad_out, recipe.activations, dim=1, dtype=recipe.grad_dtype)
        if stats is not None:
            stats.record("grad_output", grad_out, gq)
        grad_x = fp8_blockwise_mm(gq.data, gq.scale, w_data.t(), w_factor.t(), b_blocks=True)
        grad_x = grad_x.to(ctx.dtypes[0])
    if ctx.needs_input_grad[1]:
        x_hat = dequantize(x_data, x_factor, ctx.groups[0], recipe.rule)
        g_t = _token_quantized(recipe, stats, "grad_output_t", grad_out, E4M3)
        x_t = _token_quantized(recipe, stats, "input_t", x_hat, E4M3)
        grad_w = fp8_blockwise_mm(
            g_t.data.t(), g_t.scale.t(), x_t.data.t(), x_t.scale.t(), b_blocks=False
        ).to(ctx.dtypes[1])
    return grad_x, grad_w


def _saved_operands(ctx) -> tuple[Tensor, Tensor]:
    """The forward's input and weight: as they came, or (DeepSeek) their fp8 copies
    dequantised, the values the forward GEMM multiplied."""
    if not ctx.recipe.from_fp8_copies:
        return ctx.saved_tensors
    x_data, x_factor, w_data, w_factor = ctx.saved_tensors
    rule, (x_group, w_group) = ctx.recipe.rule, ctx.groups
    return dequantize(x_data, x_factor, x_group, rule), dequantize(w_data, w_factor, w_group, rule)


def _weight_for_grad_input(recipe: Fp8Recipe, stats: LayerStats | None, weight: Tensor) -> Tensor:
    """The weight (N, K) dequantised as grad_input's operand: its scales along N."""
    q = recipe.cast(weight, recipe.weights, dim=0)
    if stats is not None:
        stats.record("weight_t", weight, q)
    return q.dequantize()


def _token_operand(
    recipe: Fp8Recipe, stats: LayerStats | None, operand: str, t: Tensor, dtype: torch.dtype
) -> Tensor:
    """``t`` (M, C) dequantised as grad_weight's operand: scales along the M tokens. 128x1
    tiles need M a multiple of 128; zero rows fill the last tile, which changes neither its
    amax nor any product (as a masked kernel tile would), and are cut off again."""
    return _token_quantized(recipe, stats, operand, t, dtype).dequantize()[: t.size(0)]


def _token_quantized(
    recipe: Fp8Recipe, stats: LayerStats | None, operand: str, t: Tensor, dtype: torch.dtype
) -> Quantized:
    """``t`` (M, C) cast with its scales along the M tokens, zero rows padding M to the tile
    (see :func:`_token_operand`)."""
    pad = -t.size(0) % TILE if recipe.activations == "tile" else 0
    padded = F.pad(t, (0, 0, 0, pad)) if pad else t
    q = recipe.cast(padded, recipe.activations, dim=0, dtype=dtype)
    if stats is not None:
        stats.record(operand, padded, q)
    return q


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run on fp8 operands per ``recipe``: emulated in fp32, or
    with ``kernel`` (deepseek only) on our Triton GEMM, which needs a GPU with fp8 tensor
    cores. Parameters, their names and dtypes are nn.Linear's; the output is in the input's
    dtype (the autocast dtype under autocast), with the bias added in fp32. ``stats``: None,
    or a :class:`LayerStats` that every GEMM records into (see :func:`record_fp8_stats`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str = "deepseek",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kernel: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = get_recipe(recipe)
        if kernel and not self.recipe.from_fp8_copies:
            raise ConfigError(
                f"our fp8 Triton GEMM serves the deepseek recipe, not {recipe} (torchao's "
                "Float8Linear runs tensorwise and rowwise on a GPU)"
            )
        self.kernel = kernel
        self.stats: LayerStats | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str, kernel: bool = False) -> Fp8Linear:
        """An Fp8Linear holding ``linear``'s own Parameter objects (no copy, no allocation)."""
        new = cls(
            linear.in_features, linear.out_features, False, recipe, device="meta", kernel=kernel
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # As torchao's Float8Linear: the input arrives in the autocast dtype (the paper's
            # BF16 activations); the weight is cast from its fp32 master straight to fp8.
            x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            out = _Fp8Matmul.apply(
                x.reshape(-1, self.in_features), self.weight, self.recipe, self.stats, self.kernel
            )
            if self.bias is not None:
                out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        gemm = "triton" if self.kernel else "emulated"
        return f"{super().extra_repr()}, recipe={self.recipe.name}, gemm={gemm}"


WRAPPER_PARTS = frozenset(
    {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)


@contextlib.contextmanager
def record_fp8_stats(model: nn.Module, stats: Fp8Stats | None = None) -> Iterator[Fp8Stats]:
    """Every Fp8Linear of ``model`` records into one :class:`Fp8Stats` (``stats``, adding to
    what it holds, or a new one), under its name in ``model`` (wrappers' parts of the name
    left out), until the block ends."""
    stats = Fp8Stats() if stats is None else stats
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    for name, m in linears:
        m.stats = stats.layer(plain_name(name))
    try:
        yield stats
    finally:
        for _, m in linears:
            m.stats = None


def plain_name(name: str) -> str:
    """A module's name without the parts DDP, torch.compile and activation checkpointing
    insert: ``module._orig_mod.layers.0._checkpoint_wrapped_module.attn.wq`` ->
    ``layers.0.attn.wq``."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)
