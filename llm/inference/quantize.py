"""Weight-only INT4 quantisation of a trained model: round-to-nearest (RTN) or AWQ.

The format is AWQ's (``w_bit=4, q_group_size=128, zero_point=True``): each group of
``group_size`` consecutive input weights of an output row has a float scale and an integer
zero point, w ~ (q - z) * scale with q, z in 0..15. Two codes share a byte, the first of a
pair in the high nibble (the order torch's CUDA tinygemm packing reads). The linears of the
transformer blocks are replaced; the embedding and the output head stay as they are, as AWQ
keeps them.

:class:`QuantizedLinear` computes with the dequantised weight (the reference path), or with
torch's int4 kernels once :meth:`QuantizedLinear.use_kernel` has packed their layout:
``_weight_int4pack_mm`` on CUDA (bf16), ``_weight_int4pack_mm_for_cpu`` on CPU. Those
kernels take a float zero point: w = (q - 8) * scale + zero, so ours maps to
zero = (8 - z) * scale exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm.data.dataset import IGNORE, Batch
from llm.errors import ConfigError
from llm.inference.awq import GRID, AWQResult, awq_scale
from llm.models.layers import GeluMLP, SwiGLU
from llm.models.transformer import model_blocks

GROUP_SIZE = 128
MAX_CODE = 15  # 4 bits, unsigned
METHODS = ("rtn", "awq")
KERNEL_MIDPOINT = 8  # tinygemm's codes are centred on 8
CUDA_INNER_K_TILES = 8  # tinygemm's tile depth: K must be a multiple of 8 x 16


def quantize_groups(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K) -> codes (N, K) uint8, scales (N, K/g) fp32, zeros (N, K/g) uint8.

    AWQ's pseudo_quantize_tensor, with the range widened to hold 0: for a group holding both
    signs (every trained weight group) nothing changes; a one-signed group keeps an integer
    zero point inside 0..15 (AWQ's would clamp it and lose the group: a constant c comes
    back as 1e-5) and a zero weight stays exactly 0."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)  # (N, G, g)
    lo = groups.amin(-1).clamp(max=0)  # (N, G)
    hi = groups.amax(-1).clamp(min=0)
    scales = (hi - lo).clamp(min=1e-5) / MAX_CODE
    zeros = (-torch.round(lo / scales)).clamp(0, MAX_CODE)
    codes = (torch.round(groups / scales[..., None]) + zeros[..., None]).clamp(0, MAX_CODE)
    return codes.reshape(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_groups(codes: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """codes (N, K), scales and zeros (N, G) -> the fp32 weight (N, K) they stand for."""
    n, k = codes.shape
    groups = codes.float().reshape(n, scales.size(1), -1)  # (N, G, g)
    return ((groups - zeros.float()[..., None]) * scales[..., None]).reshape(n, k)


def fake_quantize(w: Tensor, group_size: int = GROUP_SIZE) -> Tensor:
    """The weight RTN leaves: quantised and dequantised, in w's dtype (AWQ searches with it)."""
    return dequantize_groups(*quantize_groups(w, group_size)).to(w.dtype)


def pack_int4(codes: Tensor) -> Tensor:
    """codes (N, K) in 0..15 -> (N, K/2) uint8, code 2i in the high nibble, 2i+1 in the low."""
    return (codes[:, ::2] << 4) | codes[:, 1::2]


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K/2) uint8 -> codes (N, K) uint8; the inverse of :func:`pack_int4`."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(1)


class QuantizedLinear(nn.Module):
    """y = (x / input_divisor) @ dequant(W)^T + bias, W held as INT4 groups.

    ``input_divisor`` (K,): AWQ's per-input-channel scale s where 1/s cannot be folded into
    a preceding norm (the attention output, the MLP hidden): W was multiplied by s before
    quantising, so dividing the input by s gives back x @ W^T."""

    def __init__(
        self,
        packed: Tensor,
        scales: Tensor,
        zeros: Tensor,
        bias: Tensor | None,
        input_divisor: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.size(0), packed.size(1) * 2
        self.group_size = self.in_features // scales.size(1)
        self.register_buffer("packed", packed)  # (N, K/2) uint8
        self.register_buffer("scales", scales)  # (N, K/g)
        self.register_buffer("zeros", zeros)  # (N, K/g) uint8
        self.register_buffer("bias", bias)  # (N,) or None
        self.register_buffer("input_divisor", input_divisor)  # (K,) or None
        self.kernel_weight: Tensor | None = None  # torch's int4 layout, once use_kernel ran
        self.kernel_scales_zeros: Tensor | None = None  # (K/g, N, 2)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int, input_divisor: Tensor | None = None
    ) -> QuantizedLinear:
        """RTN of ``linear``'s weight (already multiplied by ``input_divisor`` when given)."""
        codes, scales, zeros = quantize_groups(linear.weight, group_size)
        dtype = linear.weight.dtype
        bias = None if linear.bias is None else linear.bias.detach().clone()
        divisor = None if input_divisor is None else input_divisor.detach().to(dtype)
        return cls(pack_int4(codes), scales.to(dtype), zeros, bias, divisor)

    def weight(self) -> Tensor:
        """The dequantised weight (N, K) in the scales' dtype."""
        codes = unpack_int4(self.packed)
        return dequantize_groups(codes, self.scales.float(), self.zeros).to(self.scales.dtype)

    @torch.no_grad()
    def use_kernel(self, dtype: torch.dtype) -> None:
        """Pack torch's int4 layout for this module's device; forward then runs the kernel
        on inputs of ``dtype`` (CUDA's kernel takes bf16 only)."""
        codes = unpack_int4(self.packed)
        if self.packed.is_cuda:
            self.kernel_weight = torch._convert_weight_to_int4pack(
                self.packed.contiguous(), CUDA_INNER_K_TILES
            )
        else:
            self.kernel_weight = torch._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        scales = self.scales.float()
        zero = (KERNEL_MIDPOINT - self.zeros.float()) * scales  # (N, G): w = (q - 8) s + zero
        self.kernel_scales_zeros = torch.stack((scales, zero), -1).transpose(0, 1).contiguous()
        self.kernel_scales_zeros = self.kernel_scales_zeros.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_divisor is not None:
            x = x / self.input_divisor
        if self.kernel_weight is None:
            return F.linear(x, self.weight().to(x.dtype), self.bias)
        mm = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
        flat = x.reshape(-1, self.in_features).to(self.kernel_scales_zeros.dtype).contiguous()
        y = mm(flat, self.kernel_weight, self.group_size, self.kernel_scales_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        scaled = ", input_divisor" if self.input_divisor is not None else ""
        return f"{self.in_features}, {self.out_features}, int4 g{self.group_size}{scaled}"


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears AWQ quantises, by their name in ``model``: each block's wq, wk, wv, wo
    and MLP w1 (w3), w2; not the embedding or the output head."""
    found = {}
    for i, block in enumerate(model_blocks(model)):
        if not isinstance(block.feed_forward, GeluMLP | SwiGLU):
            raise ConfigError(
                f"block {i} has a {type(block.feed_forward).__name__} feed-forward; INT4 "
                "quantisation covers dense models (GeluMLP, SwiGLU) only"
            )
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                found[f"layers.{i}.{name}"] = module
    return found


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int = GROUP_SIZE,
    calibration: Tensor | None = None,
    awq_grid: tuple[float, ...] = GRID,
) -> AWQResult | None:
    """Replace the block linears of ``model`` by :class:`QuantizedLinear`, in place: RTN,
    or AWQ's scale search (over the alphas ``awq_grid``) on ``calibration`` token ids
    (N, T) first. Returns AWQ's record (the alpha of each group), None for RTN."""
    if method not in METHODS:
        raise ConfigError(f"quantization method {method!r} is unknown; use one of {METHODS}")
    linears = block_linears(model)
    for name, linear in linears.items():
        if linear.in_features % group_size:
            raise ConfigError(
                f"{name} has in_features={linear.in_features}, not a multiple of "
                f"group_size={group_size}; choose a group size that divides it"
            )
    if method == "awq" and calibration is None:
        raise ConfigError("AWQ needs calibration data (token ids, N x T); give calibration=")
    record = None
    if method == "awq":
        quantizer = partial(fake_quantize, group_size=group_size)
        record = awq_scale(model, calibration, quantizer, awq_grid)
    divisors = {} if record is None else record.divisors
    for name, linear in linears.items():
        quantized = QuantizedLinear.from_linear(linear, group_size, divisors.get(name))
        _set_module(model, name, quantized)
    return record


def torchao_int4(model: nn.Module, group_size: int = GROUP_SIZE) -> str:
    """torchao's INT4 weight-only quantisation of the same linears, in place; returns which
    config ran. CUDA: ``Int4WeightOnlyConfig`` (tinygemm layout, bf16 models only). CPU:
    that config does not run there (its default layout needs the mslk package, the tinygemm
    one CUDA, plain_int32 an XPU or NPU), so the prototype ``PrototypeInt4WeightOnlyConfig``
    (Int4OpaqueTensor, torch's CPU int4 kernel). Both choose a float zero point
    (w = (q - 8) s + zero, from the group's min and max: 0 need not be representable)."""
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    names = set(block_linears(model))
    if next(model.parameters()).is_cuda:
        config = Int4WeightOnlyConfig(
            group_size=group_size, int4_packing_format="tile_packed_to_4d"
        )
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=group_size)
    quantize_(model, config, filter_fn=lambda _module, fqn: fqn in names)
    return type(config).__name__


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tied matrix counted once; a tensor
    subclass such as torchao's by the tensors it holds)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if hasattr(t, "__tensor_flatten__"):
            total += sum(_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
        elif t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += _bytes(t)
    return total


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def sequence_losses(model: nn.Module, batches: Iterable[Batch]) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy and target count of each sequence (rows without targets, a
    loader's padding, left out), both (n,) fp64: the same sequences under two models give
    paired differences. No document mask, as the trainer's validation without
    attention.document_mask."""
    model.eval()
    device = next(model.parameters()).device
    sums, counts = [], []
    for batch in batches:
        logits = model(batch.input_ids.to(device)).float()  # (B, T, V)
        targets = batch.targets.to(device)
        nll = F.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
        )
        sums.append(nll.sum(1).double().cpu())  # (B,)
        counts.append((targets != IGNORE).sum(1).double().cpu())
    sums, counts = torch.cat(sums), torch.cat(counts)
    return sums[counts > 0], counts[counts > 0]


def token_loss(model: nn.Module, batches: Iterable[Batch]) -> float:
    """Mean cross-entropy per target token of ``model`` over ``batches``."""
    sums, counts = sequence_losses(model, batches)
    return (sums.sum() / counts.sum().clamp(min=1)).item()
