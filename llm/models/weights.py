"""Where initial weights come from, one parameter (or a few of its rows) at a time.

A strategy that shards before materialising asks a :class:`WeightSource` only for what its
rank holds: ``rows(name, start, stop, device)`` is dim-0 rows [start, stop) of a parameter
in fp32 (FSDP2 shards dim 0, our ZeRO cuts flat ranges that ``flat_range`` turns into rows).
Sources: :class:`InitSource` (our seeded GPT-2 init), :class:`ModuleSource` (an already
materialised module), and ``HFSource`` in ``hf_source.py`` (a safetensors checkpoint).

Names are the model's parameter names without wrapper infixes (recompute's checkpoint
wrapper, torch.compile); a tied weight is one parameter and is asked for under its first
name (``tok_embeddings.weight``), as ``named_parameters`` lists it.
"""

from __future__ import annotations

import hashlib
import math
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# What DTensor itself uses to place a shard; torch 2.13 exports it from no public module.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import swap_tensors

from llm.models.args import ModelArgs
from llm.models.layers import RMSNorm
from llm.models.moe import Experts
from llm.models.transformer import Transformer

_WRAPPER_INFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def param_name(name: str) -> str:
    """``name`` as the model without wrappers calls it."""
    for infix in _WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name


class WeightSource(Protocol):
    def shape(self, name: str) -> torch.Size: ...

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        """Dim-0 rows [start, stop) of parameter ``name``, fp32, on ``device``; read-only
        (it may be a view of the source's own tensor): callers copy out of it."""
        ...

    def whole(self, name: str, device: torch.device) -> Tensor:
        return self.rows(name, 0, self.shape(name)[0], device)


def flat_range(weights: WeightSource, name: str, start: int, stop: int, device) -> Tensor:
    """Elements [start, stop) of the flattened parameter, reading only the rows they span."""
    shape = weights.shape(name)
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    block = weights.rows(name, first, last, device).reshape(-1)
    return block[start - first * row : stop - first * row]


class InitSource(WeightSource):
    """GPT-2 init (Radford et al. 2019): N(0, init_std) for matrices and embeddings, zeros
    for biases, ones for norm gains; the projections that write into the residual stream
    (wo, w2) get init_std / sqrt(2 * n_layers), since 2 * n_layers of them add up along the
    residual path.

    Each parameter draws from its own generator, seeded from (seed, name): any parameter
    can be produced alone, in any order, on any rank, with the same bits as in a
    single-process run on the same device type (CPU and CUDA generators differ). Rows of a
    random matrix cost one full temporary of that parameter.
    """

    def __init__(self, args: ModelArgs, seed: int) -> None:
        self.seed = seed
        with torch.device("meta"):  # shapes and init kinds only: no storage
            model = Transformer(args)
        residual_std = args.init_std / math.sqrt(2 * args.n_layers)
        self._shapes = {n: p.shape for n, p in model.named_parameters()}
        self._std: dict[str, float] = {}  # random parameters; the rest are constants
        self._fill: dict[str, float] = {}
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, Experts):
                for weight in ("w1", "w3", "w2"):
                    self._std[f"{prefix}{weight}"] = (
                        residual_std if weight == "w2" else args.init_std
                    )
            elif isinstance(module, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith((".wo", ".w2")) else args.init_std
                self._std[f"{prefix}weight"] = std
                if getattr(module, "bias", None) is not None:
                    self._fill[f"{prefix}bias"] = 0.0
            elif isinstance(module, nn.LayerNorm | RMSNorm):
                self._fill[f"{prefix}weight"] = 1.0
                if getattr(module, "bias", None) is not None:
                    self._fill[f"{prefix}bias"] = 0.0

    def shape(self, name: str) -> torch.Size:
        return self._shapes[param_name(name)]

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        name = param_name(name)
        shape = self._shapes[name]
        if name in self._fill:
            return torch.full((stop - start, *shape[1:]), self._fill[name], device=device)
        generator = torch.Generator(device=device).manual_seed(self._seed_of(name))
        values = torch.empty(shape, device=device)
        values.normal_(0.0, self._std[name], generator=generator)
        return values[start:stop]

    def _seed_of(self, name: str) -> int:
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes < 2**63


class ModuleSource(WeightSource):
    """The current values of an already materialised module (tests, benchmarks, and
    strategies handed a materialised model). Holds its own references, so the values stay
    readable after a strategy moves the module's parameters into its own buffers. A DTensor
    parameter (tensor parallel) is its local block: the source's shape is the local one."""

    def __init__(self, module: nn.Module) -> None:
        self._tensors = {
            param_name(n): (p.to_local() if isinstance(p, DTensor) else p).detach()
            for n, p in module.named_parameters()
        }

    def shape(self, name: str) -> torch.Size:
        return self._tensors[param_name(name)].shape

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        return self._tensors[param_name(name)][start:stop].to(device, torch.float32)


def adopt(param: nn.Parameter, value: Tensor) -> None:
    """Make ``param`` hold ``value`` (same shape) and stay the same Python object, so tied
    modules and references held elsewhere see it. A meta parameter cannot take ``.data``
    from a real tensor: it is first swapped for an empty one on ``value``'s device. ``.data``
    keeps the parameter's own version counter, so writes into a buffer it views (ZeRO-3's
    gathers) do not invalidate what autograd saved. A DTensor parameter (tensor parallel)
    keeps its mesh and placements and takes ``value`` (its local block's shape) as its local
    tensor, a view of ``value``'s storage; autograd saves the DTensor, whose version counter
    is its own, so writes into ``value`` do not invalidate it either."""
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
        swap_tensors(param, nn.Parameter(local, requires_grad=param.requires_grad))
        return
    if param.is_meta:
        empty = nn.Parameter(value.new_empty(0), requires_grad=param.requires_grad)
        swap_tensors(param, empty)
    param.data = value


def local_region(param: DTensor) -> tuple[list[int], list[int]]:
    """(shape, global offset) of this rank's shard of DTensor ``param`` (on any mesh whose
    placements are Shard or Replicate: tensor parallel's column and row splits)."""
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return list(shape), list(offset)


def _read_block(weights, name, shape, offset, start: int, stop: int, device) -> Tensor:
    """Rows [start, stop) of the block of ``shape`` at ``offset`` in parameter ``name``: its
    rows read as rows, then narrowed to its columns (a column range costs the whole rows)."""
    block = weights.rows(name, offset[0] + start, offset[0] + stop, device)
    for dim in range(1, len(shape)):
        if block.shape[dim] != shape[dim]:
            block = block.narrow(dim, offset[dim], shape[dim])
    return block


def local_block(weights: WeightSource, name: str, param: DTensor, device) -> Tensor:
    """The part of parameter ``name`` that this rank's shard of DTensor ``param`` covers."""
    shape, offset = local_region(param)
    return _read_block(weights, name, shape, offset, 0, shape[0], device)


class LocalSource(WeightSource):
    """``weights`` as this rank's blocks of ``model``'s DTensor parameters (tensor parallel):
    each such parameter reads as if its local block were the whole parameter, so a strategy
    that cuts flat ranges of what a rank holds (our ZeRO) reads only those. Plain parameters
    read as in ``weights``."""

    def __init__(self, weights: WeightSource, model: nn.Module) -> None:
        self.weights = weights
        self._regions = {
            param_name(n): local_region(p)
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        }

    def shape(self, name: str) -> torch.Size:
        region = self._regions.get(param_name(name))
        return torch.Size(region[0]) if region else self.weights.shape(name)

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        region = self._regions.get(param_name(name))
        if region is None:
            return self.weights.rows(name, start, stop, device)
        return _read_block(self.weights, name, *region, start, stop, device)


@torch.no_grad()
def materialize_from(model: nn.Module, weights: WeightSource, device: torch.device) -> nn.Module:
    """Allocate every parameter of ``model`` still on the meta device on ``device`` (in its
    dtype) and fill it from ``weights``, one parameter at a time; tied weights stay tied. A
    DTensor parameter (tensor parallel) gets only this rank's shard."""
    device = torch.device(device)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and param.is_meta:
            local = torch.empty(param.to_local().shape, dtype=param.dtype, device=device)
            local.copy_(local_block(weights, name, param, device))
            value = DTensor.from_local(
                local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
            swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
        elif param.is_meta:
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            value.copy_(weights.whole(name, device))
            adopt(param, value)
    for module in model.modules():
        # Buffers start at zero (the MoE router's bias is the one there is): no source has them.
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                module.register_buffer(
                    name, torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
                )
    return model
