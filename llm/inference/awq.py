"""AWQ's scale search (Lin et al., 2023, arXiv:2306.00978, section 3; llm-awq's
``auto_scale.py``): activation-aware per-input-channel scaling before INT4 quantisation.

A weight column that meets large activations matters more. Multiplying it by s > 1 before
quantising (and dividing its input by s) shrinks its relative rounding error, while the
group's scale barely moves. For each group of linears that share an input, with x_mean the
mean |x| of each input channel over the calibration tokens, AWQ tries
s = x_mean^alpha / sqrt(max * min) for alpha on a grid 0, 1/20, ..., 19/20, quantises
W diag(s), and keeps the alpha whose sub-module output is nearest (MSE) to the unquantised
one. alpha = 0 is plain round-to-nearest. Salient channels are protected by this scaling,
not kept in fp16.

1/s goes into the norm in front where the input is that norm's output (exactly
equivalent: the norm's gain, and LayerNorm's bias, divided by s); elsewhere (the attention
output, the MLP hidden) the quantised linear keeps s as an input divisor. Blocks are
processed in order; as in llm-awq's run_awq, each block's calibration input is the previous
block's unquantised output, and every group of a block is searched before any is folded.
llm-awq's weight clipping search (auto_clip) is not part of this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from llm.models.layers import SwiGLU
from llm.models.transformer import model_blocks

N_GRID = 20  # llm-awq's n_grid
GRID = tuple(i / N_GRID for i in range(N_GRID))
MIN_SCALE = 1e-4  # llm-awq's clamp on x_mean^alpha


@dataclass
class AWQResult:
    divisors: dict[str, Tensor] = field(default_factory=dict)  # linear's name -> s (K,)
    alphas: dict[str, float] = field(default_factory=dict)  # "layers.i.<group>" -> alpha
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # (at alpha 0, best)
    # max / median over input channels of mean|x|: how far the most salient channel stands out
    outliers: dict[str, float] = field(default_factory=dict)


@dataclass
class ScaleGroup:
    """Linears that share one input, where 1/s goes, and the module whose output is compared."""

    name: str
    norm: nn.Module | None  # None: the linears keep s as an input divisor
    linears: dict[str, nn.Linear]  # by name inside the block
    inspect: nn.Module  # takes the linears' input, (B, T, K)


def _groups(block: nn.Module) -> list[ScaleGroup]:
    attn, ff = block.attention, block.feed_forward
    up = {"feed_forward.w1": ff.w1}
    if isinstance(ff, SwiGLU):
        up["feed_forward.w3"] = ff.w3
    qkv = {f"attention.{n}": getattr(attn, n) for n in ("wq", "wk", "wv")}
    return [
        ScaleGroup("attention_input", block.attention_norm, qkv, attn),
        ScaleGroup("attention_output", None, {"attention.wo": attn.wo}, attn.wo),
        ScaleGroup("mlp_input", block.ffn_norm, up, ff),
        ScaleGroup("mlp_hidden", None, {"feed_forward.w2": ff.w2}, ff.w2),
    ]


class _Stop(Exception):
    """Raised by the hook that caught block 0's input: the rest of the forward is not needed."""


def _first_block_input(model: nn.Module, ids: Tensor) -> Tensor:
    """The hidden states (N, T, d) entering block 0 for token ids (N, T)."""
    caught = []

    def catch(_module, args):
        caught.append(args[0])
        raise _Stop

    handle = model_blocks(model)[0].register_forward_pre_hook(catch)
    try:
        model(ids)
    except _Stop:
        pass
    finally:
        handle.remove()
    return caught[0]


def _run_capturing(block: nn.Module, x: Tensor) -> tuple[Tensor, dict[nn.Module, Tensor]]:
    """block(x), and the input (N, T, K) each of its linears received."""
    inputs: dict[nn.Module, Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda m, args, _out: inputs.__setitem__(m, args[0]))
        for m in block.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        out = block(x)
    finally:
        for h in hooks:
            h.remove()
    return out, inputs


def normalized_scales(x_mean: Tensor, alpha: float) -> Tensor:
    """s = x_mean^alpha, divided by sqrt(max(s) * min(s)) as llm-awq does (K,)."""
    s = x_mean.pow(alpha).clamp(min=MIN_SCALE)
    return s / (s.max() * s.min()).sqrt()


def search_scale(
    group: ScaleGroup,
    x: Tensor,
    quantize_weight: Callable[[Tensor], Tensor],
    grid: tuple[float, ...],
) -> tuple[float, Tensor, float, float]:
    """The grid's alpha whose quantised W diag(s) gives ``group.inspect`` the output nearest
    its unquantised one on ``x`` (N, T, K): (alpha, s (K,), its MSE, the MSE at alpha 0)."""
    x_mean = x.abs().reshape(-1, x.size(-1)).float().mean(0)  # (K,)
    reference = group.inspect(x)
    originals = {lin: lin.weight.detach().clone() for lin in group.linears.values()}
    best = (float("inf"), grid[0], None)
    rtn_error = float("nan")
    try:
        for alpha in grid:
            s = normalized_scales(x_mean, alpha).to(x.dtype)
            for lin, w in originals.items():
                lin.weight.copy_(quantize_weight(w * s) / s)
            error = (group.inspect(x) - reference).float().pow(2).mean().item()
            rtn_error = error if alpha == 0 else rtn_error
            if error < best[0]:
                best = (error, alpha, s)
    finally:
        for lin, w in originals.items():
            lin.weight.copy_(w)
    return best[1], best[2], best[0], rtn_error


def _fold(group: ScaleGroup, s: Tensor) -> bool:
    """W diag(s) for every linear of the group, and 1/s into its norm; False where there is
    no norm (the caller keeps s as the linears' input divisor)."""
    for lin in group.linears.values():
        lin.weight.mul_(s)  # (N, K) * (K,)
    if group.norm is None:
        return False
    group.norm.weight.div_(s)
    if getattr(group.norm, "bias", None) is not None:
        group.norm.bias.div_(s)
    return True


@torch.no_grad()
def awq_scale(
    model: nn.Module,
    calibration: Tensor,
    quantize_weight: Callable[[Tensor], Tensor],
    grid: tuple[float, ...] = GRID,
) -> AWQResult:
    """Search and apply AWQ's scales on ``model`` in place (still unquantised afterwards,
    and equivalent to it but for the input divisors returned) with ``quantize_weight``
    (W -> its dequantised INT4 value) on ``calibration`` token ids (N, T)."""
    model.eval()
    device = next(model.parameters()).device
    x = _first_block_input(model, calibration.to(device))  # (N, T, d)
    result = AWQResult()
    for i, block in enumerate(model_blocks(model)):
        out, inputs = _run_capturing(block, x)
        found = []
        for group in _groups(block):
            first = next(iter(group.linears.values()))
            alpha, s, error, rtn_error = search_scale(group, inputs[first], quantize_weight, grid)
            found.append((group, s))
            result.alphas[f"layers.{i}.{group.name}"] = alpha
            result.errors[f"layers.{i}.{group.name}"] = (rtn_error, error)
            x_mean = inputs[first].abs().reshape(-1, first.in_features).float().mean(0)
            result.outliers[f"layers.{i}.{group.name}"] = (x_mean.max() / x_mean.median()).item()
        for group, s in found:
            if not _fold(group, s):
                result.divisors.update({f"layers.{i}.{n}": s for n in group.linears})
        x = out
    return result
