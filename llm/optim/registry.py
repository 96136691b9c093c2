"""What each optimizer declares, in one place: how to build it, the bytes of state it keeps
per parameter tensor, and what it needs from a strategy that shards parameters.

The declaration is read by the memory accounting's tests (the measured ``optimizer_states``
bytes must equal it) and by whatever sizes a run before it starts; the layout is read by
``llm.parallel.strategy.refuse_optimizer`` so that a strategy that cannot run an optimizer
exactly refuses it before any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llm.config import OptimizerConfig

OptimizerBuilder = Callable[[list[dict[str, Any]], OptimizerConfig], torch.optim.Optimizer]
# bytes(shape, group kind, cfg): the state one parameter tensor of ``shape`` (fp32) carries
# in a param group of that kind ("matrix", "vector", or muon's "hidden").
TensorStateBytes = Callable[[tuple[int, ...], str, OptimizerConfig], int]

# What an optimizer's arithmetic needs to see of a parameter:
ELEMENTWISE = "elementwise"  # each element on its own: any shard will do
PARAM_NORMS = "param_norms"  # element-wise, plus norms over whole parameters (LAMB)
WHOLE_MATRICES = "whole_matrices"  # row/column statistics or products of whole matrices
QUANT_BLOCKS = "quant_blocks"  # blocks of the flattened tensor share one scale (8-bit)
LAYOUTS = (ELEMENTWISE, PARAM_NORMS, WHOLE_MATRICES, QUANT_BLOCKS)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: OptimizerBuilder
    state_bytes: TensorStateBytes
    layout: str
    # Bytes held once per optimizer, from its parameters' shapes (bitsandbytes' quantisation
    # maps, shared by every quantised tensor).
    shared_state_bytes: Callable[[list[tuple[int, ...]], OptimizerConfig], int] | None = None
    # True: it asks for an extra backward on chosen steps (llm/optim/gradient_pass.py).
    gradient_pass: bool = False
    # Whether it splits matrices inside transformer blocks from embeddings and the head
    # (param_groups(..., split_hidden=True)): Muon.
    split_hidden: bool = False
    # Under a shard layout, the state of one piece when it is not ``state_bytes`` of the
    # piece's own shape: (piece shape, whole shape, group kind, cfg) -> bytes (Adafactor
    # keeps a matrix's statistics whole; 8-bit AdamW decides min_8bit_size on the whole).
    piece_state_bytes: (
        Callable[[tuple[int, ...], tuple[int, ...], str, OptimizerConfig], int] | None
    ) = None
    # Elements per quantisation block (QUANT_BLOCKS layout): a sharded strategy cuts each
    # parameter at multiples of it.
    quant_block: int = 0


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(
    name: str,
    state_bytes: TensorStateBytes,
    layout: str = ELEMENTWISE,
    **spec: Any,
) -> Callable[[OptimizerBuilder], OptimizerBuilder]:
    """Decorator: make ``builder(param_groups, cfg)`` available as ``optimizer=name``, with
    its state declaration and the layout it needs."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")

    def decorator(builder: OptimizerBuilder) -> OptimizerBuilder:
        OPTIMIZERS[name] = OptimizerSpec(name, builder, state_bytes, layout, **spec)
        return builder

    return decorator


def per_element(nbytes: int, step_bytes: int = 0) -> TensorStateBytes:
    """``nbytes`` per element, plus ``step_bytes`` per tensor (torch's fp32 ``step`` tensor)."""

    def state_bytes(shape: tuple[int, ...], kind: str, cfg: OptimizerConfig) -> int:
        return nbytes * _numel(shape) + step_bytes

    return state_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def declared_state_bytes(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> int:
    """Bytes of state ``optimizer`` declares for the parameters it holds (after a first
    step: the state is made lazily), read from the spec of ``cfg.name``."""
    layout = getattr(optimizer, "shard_layout", None)
    entries = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            piece = tuple(_local(p).shape)
            whole = layout.parameter_of(p)[1].shape if layout is not None else piece
            entries.append((piece, whole, group.get("kind", "matrix")))
    return pieces_state_bytes(cfg, entries)


def pieces_state_bytes(
    cfg: OptimizerConfig, entries: list[tuple[tuple[int, ...], tuple[int, ...], str]]
) -> int:
    """Bytes of state over ``(piece shape, whole shape, group kind)`` entries: a tensor the
    optimizer steps, and the parameter it is part of (the same shape when it is whole). What
    a rank holds, declared (above) and estimated (llm/estimate/states.py) alike."""
    spec = OPTIMIZERS[cfg.name]
    shared = (
        spec.shared_state_bytes([w for _, w, _ in entries], cfg) if spec.shared_state_bytes else 0
    )
    if spec.piece_state_bytes is not None:
        return shared + sum(spec.piece_state_bytes(p, w, k, cfg) for p, w, k in entries)
    return shared + sum(spec.state_bytes(p, k, cfg) for p, _, k in entries)


def declared_bytes_per_parameter(
    cfg: OptimizerConfig, shapes: list[tuple[tuple[int, ...], str]]
) -> float:
    """State bytes per parameter element over ``(shape, group kind)`` pairs: the figure
    docs/optimizers.md and the benchmark report."""
    total = pieces_state_bytes(cfg, [(shape, shape, kind) for shape, kind in shapes])
    return total / max(1, sum(_numel(s) for s, _ in shapes))


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's shard is what this rank holds
    return to_local() if to_local is not None else t
