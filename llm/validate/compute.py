"""The cross-group checks of what a step computes with: the attention kernel against the
model, precision and device, the fused loss, and recompute policies that need compile or a
GPU."""

from __future__ import annotations

import torch

from llm.attention import check_kernel, resolve_for
from llm.config import Config
from llm.errors import ConfigError
from llm.models import ModelArgs
from llm.train.loss import unavailable as fused_loss_unavailable


def validate_fused_loss(cfg: Config, device: torch.device) -> None:
    """train.fused_loss: where the model's forward computes the loss (llm/train/loss.py)."""
    name, p = cfg.train.fused_loss, cfg.parallelism
    if name == "off":
        return
    if p.pp_size > 1:
        raise ConfigError(
            f"train.fused_loss={name} with parallelism.pp_size={p.pp_size}: the pipeline "
            "schedule computes the loss from the last stage's logits; set train.fused_loss=off"
        )
    if p.tp_size > 1:
        raise ConfigError(
            f"train.fused_loss={name} with parallelism.tp_size={p.tp_size}: tensor parallel's "
            "head leaves vocab-sharded logits to its vocab-parallel loss; set "
            "train.fused_loss=off"
        )
    if reason := fused_loss_unavailable(name, device):
        raise ConfigError(reason)


def validate_recompute(cfg: Config, device: torch.device) -> None:
    """Policies that need something outside their own group."""
    name = cfg.recompute.name
    if name == "budget" and not cfg.train.compile:
        raise ConfigError(
            "recompute=budget is torch.compile's partitioner and needs train.compile=true; "
            "set it, or use recompute=op_sac/selective without compile"
        )
    if name == "offload" and device.type != "cuda":
        raise ConfigError(
            f"recompute=offload moves activations from the GPU to host memory; on "
            f"train.device={device.type} there is no host/device split, use recompute=none"
        )


def validate_attention(cfg: Config, args: ModelArgs, dtype: torch.dtype, device) -> None:
    """The attention kernel (attention=auto's pick) against what it declares it supports, for
    this model, precision and device (attention sees q, k, v in the compute dtype); training
    needs its backward."""
    a = cfg.attention
    if a.document_mask and not cfg.data.packing:
        raise ConfigError(
            "attention.document_mask=true keeps packed documents apart, but data.packing=false "
            "puts one document per sample; set data.packing=true or document_mask=false"
        )
    chosen = resolve_for(a, args, device=device, dtype=dtype, seq_len=cfg.data.seq_len)
    check_kernel(
        chosen.backend,
        chosen.kernel,
        device=device.type,
        dtype=dtype,
        head_dim=args.head_dim,
        gqa=args.n_kv_heads != args.n_heads,
        dropout=args.dropout > 0,
        document_mask=a.document_mask,
        training=True,
    )
