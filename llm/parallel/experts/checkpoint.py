"""The expert parameters in checkpoints: DTensors on the (edp, ep) mesh, Replicate x
Shard(0), viewing the same storage, so DCP reshards them to another ep size or to one
process as it does any DTensor."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from llm.parallel.experts.shards import ExpertShards


def as_dtensor(shards: ExpertShards, local: Tensor) -> DTensor:
    """``local`` (this rank's slice of an expert tensor) as the whole tensor's DTensor."""
    shape = (local.shape[0] * shards.ep, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, shards.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride
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
        return v.to_local() if name in shards.params and isinstance(v, DTensor) else v

    model = {k: local(k, v) for k, v in state["model"].items()}
    optim = {**state["optimizer"], "state": {
        name: {key: local(name, v) for key, v in entry.items()}
        for name, entry in state["optimizer"]["state"].items()
    }}  # fmt: skip
    return {**state, "model": model, "optimizer": optim}


def _leads_with(value, experts: int) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == experts
