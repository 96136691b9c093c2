"""Every ``optimizer=NAME``: its builder and its state declaration, registered by name.

Defaults live in conf/optimizer/NAME.yaml; docs/optimizers.md says where each came from.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.optim.adafactor import Adafactor
from llm.optim.adamw8bit import BNB_BLOCK, sharded_adamw8bit_class
from llm.optim.lamb import Lamb
from llm.optim.lion import Lion
from llm.optim.muon import MuonWithAdamW
from llm.optim.registry import (
    PARAM_NORMS,
    QUANT_BLOCKS,
    WHOLE_MATRICES,
    per_element,
    register_optimizer,
)
from llm.optim.sophia import SophiaG

Groups = list[dict[str, Any]]
# Device types whose params torch 2.13's fused AdamW/SGD kernels accept (floating dtypes,
# plain tensors and DTensors' local shards alike); elsewhere (meta, anything exotic)
# `optimizer.fused` is ignored so one config runs on every machine.
_FUSED_DEVICE_TYPES = ("cuda", "cpu")
ADAM_STATE = per_element(8, step_bytes=4)  # exp_avg, exp_avg_sq (fp32) and an fp32 step
BNB_QMAPS = 2 * 256 * 4  # its two quantisation maps (256 fp32 each), shared by all params


def _fused_supported(groups: Groups) -> bool:
    """Whether torch's fused kernel takes every param of ``groups``."""
    params = [p for g in groups for p in g["params"]]
    return all(p.device.type in _FUSED_DEVICE_TYPES and p.is_floating_point() for p in params)


def _fused_kwargs(groups: Groups, fused: bool | None, default: bool | None) -> dict[str, bool]:
    """``{"fused": ...}`` (``fused``, else ``default`` when ``fused`` is None) where the fused
    kernel takes the params, else ``{}``: torch's own choice, foreach where it has it."""
    fused = default if fused is None else fused
    if fused is None or not _fused_supported(groups):
        return {}
    return {"fused": fused}


def _adamw_kwargs(groups: Groups, cfg: OptimizerConfig) -> dict[str, Any]:
    """Fused by default: one kernel per device and dtype, and the only torch AdamW that takes
    ``found_inf`` (llm/parallel/step.py skips a non-finite step on the device with it) and
    keeps its step counters on the params' device; torch's unfused CPU AdamW reads each
    counter on the host (``.item()`` per param per step)."""
    return {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps} | _fused_kwargs(
        groups, cfg.fused, default=True
    )


@register_optimizer("adamw", ADAM_STATE)
def _adamw(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **_adamw_kwargs(groups, cfg))


def _sgd_state(shape, kind, cfg: OptimizerConfig) -> int:
    return 4 * math.prod(shape) if cfg.momentum else 0  # the momentum buffer


@register_optimizer("sgd", _sgd_state)
def _sgd(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=False,
        **_fused_kwargs(groups, cfg.fused, default=None),
    )


def _adafactor_state(shape, kind, cfg: OptimizerConfig) -> int:
    """Factored second moments: a row and a column vector per matrix (over its last two
    dims), a full one for vectors; plus the fp32 step."""
    if len(shape) >= 2:
        lead = math.prod(shape[:-2])
        return 4 * lead * (shape[-2] + shape[-1]) + 4
    return 4 * math.prod(shape) + 4


def _adafactor_piece_state(piece, whole, kind, cfg: OptimizerConfig) -> int:
    """A piece of a matrix: the whole matrix's row and column vectors (every rank holding a
    piece keeps them); a piece of a vector: its own elements' variance."""
    return _adafactor_state(whole if len(whole) >= 2 else piece, kind, cfg)


@register_optimizer(
    "adafactor", _adafactor_state, WHOLE_MATRICES, piece_state_bytes=_adafactor_piece_state
)
def _adafactor(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return Adafactor(
        groups,
        lr=cfg.lr,
        beta2_decay=cfg.beta2_decay,
        eps=(cfg.eps, cfg.eps2),
        d=cfg.clip_threshold,
    )


@register_optimizer("lamb", ADAM_STATE, PARAM_NORMS)
def _lamb(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return Lamb(
        groups,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        bias_correction=cfg.bias_correction,
        trust_clip=cfg.trust_clip,
    )


@register_optimizer("lion", per_element(4))
def _lion(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return Lion(groups, lr=cfg.lr, betas=cfg.betas)


@register_optimizer("sophia", per_element(8), gradient_pass=True)
def _sophia(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return SophiaG(
        groups,
        lr=cfg.lr,
        betas=cfg.betas,
        rho=cfg.rho,
        eps=cfg.eps,
        hessian_every=cfg.hessian_every,
    )


def _muon_state(shape, kind, cfg: OptimizerConfig) -> int:
    return 4 * math.prod(shape) if kind == "hidden" else ADAM_STATE(shape, kind, cfg)


@register_optimizer("muon", _muon_state, WHOLE_MATRICES, split_hidden=True)
def _muon(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    muon = {
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "nesterov": True,
        "ns_steps": cfg.ns_steps,
        "adjust_lr_fn": cfg.adjust_lr,
        "ns_dtype": getattr(torch, cfg.ns_dtype),
        "distributed": cfg.distributed,
    }
    return MuonWithAdamW(groups, muon, _adamw_kwargs(groups, cfg))


def _adamw8bit_state(shape, kind, cfg: OptimizerConfig) -> int:
    """Two uint8 moments and one fp32 absmax per block of each; fp32 moments below
    ``min_8bit_size``. bitsandbytes keeps its step as a Python int (no tensor)."""
    n = math.prod(shape)
    if n < cfg.min_8bit_size:
        return 8 * n
    return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)


def _adamw8bit_piece_state(piece, whole, kind, cfg: OptimizerConfig) -> int:
    """A piece is 8-bit when its whole tensor reaches min_8bit_size, whatever its own size
    (its blocks are the whole's: the strategy cut it at a block boundary)."""
    n = math.prod(piece)
    if math.prod(whole) < cfg.min_8bit_size:
        return 8 * n
    return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)


def _bnb_maps(shapes, cfg: OptimizerConfig) -> int:
    return BNB_QMAPS if any(math.prod(s) >= cfg.min_8bit_size for s in shapes) else 0


@register_optimizer(
    "adamw8bit",
    _adamw8bit_state,
    QUANT_BLOCKS,
    shared_state_bytes=_bnb_maps,
    quant_block=BNB_BLOCK,
    piece_state_bytes=_adamw8bit_piece_state,
)
def _adamw8bit(groups: Groups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    try:
        adamw8bit = sharded_adamw8bit_class()
    except ImportError as exc:
        raise ConfigError(
            "optimizer=adamw8bit needs bitsandbytes; install requirements.txt"
        ) from exc
    return adamw8bit(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        min_8bit_size=cfg.min_8bit_size,
    )
