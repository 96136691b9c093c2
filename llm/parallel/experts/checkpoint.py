"""The expert parameters in checkpoints: DTensors of the whole tensor on the (edp, ep) mesh,
viewing the same storage, so DCP reshards them to another ep size, another edp size or one
process as it does any DTensor. Placements: Replicate x Shard(0) where each edp rank holds
its slice whole; where FSDP also shards the slice over edp, the ep split first and the edp
split within it, (_StridedShard(0, split_factor=ep), Shard(0)), as FSDP2 over tensor
parallel places its shards."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

# FSDP2's placement for a dim-0 split inside another; torch exports it nowhere else.
from torch.distributed.tensor.placement_types import _StridedShard

from llm.parallel.experts.shards import ExpertShards


def as_dtensor(shards: ExpertShards, local: Tensor) -> DTensor:
    """``local`` (this rank's slice of an expert tensor, or a DTensor of the slice sharded
    over edp) as the whole tensor's DTensor."""
    shape = (local.shape[0] * shards.ep, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    placements = [Replicate(), Shard(0)]
    if isinstance(local, DTensor):
        placements = [_StridedShard(0, split_factor=shards.ep), Shard(0)]
        local = local.to_local()
    return DTensor.from_local(
        local, shards.mesh, placements, run_check=False, shape=shape, stride=stride
    )


def to_checkpoint(shards: ExpertShards, state: dict) -> dict:
    """``state`` ({"model", "optimizer"} as get_state_dict makes them) with every expert
    tensor, and each optimizer state tensor that has an expert's leading dimension, as a
    DTensor viewing the same storage (DCP's load writes into the parameter itself)."""
    model = dict(state["model"])
    optim = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
    for name, param in shards.params.items():
        model[name] = as_dtensor(shards, model[name])
        if name in optim["state"]:
            optim["state"][name] = optimizer_entry(shards, optim["state"][name], param)
    return {**state, "model": model, "optimizer": optim}


def optimizer_entry(shards: ExpertShards, state: dict, param: Tensor) -> dict:
    """An expert's optimizer state for a checkpoint: tensors with the slice's leading
    (experts) dimension as DTensors, the rest (AdamW's step) as they are."""
    return {
        key: as_dtensor(shards, v) if _leads_with(v, param.shape[0]) else v
        for key, v in state.items()
    }


def from_checkpoint(shards: ExpertShards, state: dict) -> dict:
    """The inverse of :func:`to_checkpoint`: the expert entries local tensors again (a
    strategy's own DTensors, FSDP's shards, stay as they are)."""

    def local(name: str, v):
        if name not in shards.params or not isinstance(v, DTensor):
            return v
        if not shards.sharded:
            return v.to_local()
        # Back to the slice's DTensor over edp (FSDP's), on the same storage.
        mesh = shards.mesh["edp"]
        shape = (v.shape[0] // shards.ep, *v.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            v.to_local(), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )

    model = {k: local(k, v) for k, v in state["model"].items()}
    optim = {**state["optimizer"], "state": {
        name: {key: local(name, v) for key, v in entry.items()}
        for name, entry in state["optimizer"]["state"].items()
    }}  # fmt: skip
    return {**state, "model": model, "optimizer": optim}


def _leads_with(value, experts: int) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == experts
