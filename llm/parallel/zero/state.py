"""ZeRO checkpoints in the same layout as every other strategy's: the model by parameter
name, the optimizer as torch DCP's ``get_state_dict`` writes it (state by parameter name,
param groups listing names). Shards are all-gathered bucket by bucket into whole
parameters, so a checkpoint saved on N ranks loads on M ranks, or under ddp, fsdp or one
process; on load every rank cuts its own slice back out.

The cost is one whole copy of the fp32 weights and optimizer states per rank while saving
(DCP writes each replicated tensor once); a sharded-on-disk format would avoid it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llm.parallel.zero.collectives import all_gather
from llm.parallel.zero.layout import clean_name


def _elementwise_keys(strategy) -> list[str]:
    """Optimizer-state entries shaped like the parameter piece (exp_avg, ...)."""
    for _, tensor in strategy.piece_params:
        st = strategy.optimizer.state.get(tensor, {})
        return sorted(
            k for k, v in st.items() if torch.is_tensor(v) and v.shape == tensor.shape and v.dim()
        )
    return []


def _scalars(strategy) -> dict:
    """Per-parameter scalars (AdamW's ``step``): the same for every piece."""
    for _, tensor in strategy.piece_params:
        st = strategy.optimizer.state.get(tensor, {})
        return {k: v for k, v in st.items() if not (torch.is_tensor(v) and v.dim())}
    return {}


def _gather_bucket(strategy, buf, local: torch.Tensor) -> torch.Tensor:
    """All-gather a rank-local slice (S elements) of a bucket into the padded whole."""
    local = local.to(strategy.device)
    full = local.new_empty(buf.bucket.padded)
    all_gather(full, local, group=strategy.group)
    return full


def _local_slice(strategy, buf, tensors_by_piece: list[torch.Tensor]) -> torch.Tensor:
    lo = buf.bucket.shard_range(strategy.rank)[0]
    out = torch.zeros(buf.bucket.shard, dtype=torch.float32, device=strategy.device)
    for piece, t in zip(buf.pieces, tensors_by_piece, strict=True):
        out[piece.start - lo : piece.stop - lo].copy_(t)
    return out


def ensure_optimizer_state(strategy) -> None:
    """Create the optimizer's lazily made state with one zero-lr step on zero gradients
    (as torch DCP does), so a checkpoint can be loaded into it."""
    optimizer = strategy.optimizer
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for _, tensor in strategy.piece_params:
        tensor.grad = torch.zeros_like(tensor)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for _, tensor in strategy.piece_params:
        tensor.grad = None


def gather_state(strategy) -> dict:
    ensure_optimizer_state(strategy)
    keys, scalars = _elementwise_keys(strategy), _scalars(strategy)
    model_sd, optim_state = {}, {}
    for buf in strategy.buffers:
        weights = _gather_bucket(strategy, buf, buf.master.float())
        states = {
            k: _gather_bucket(
                strategy,
                buf,
                _local_slice(
                    strategy, buf, [strategy.optimizer.state[t][k] for t in buf.piece_tensors]
                ),
            )
            for k in keys
        }
        for slot in buf.bucket.slots:
            span = slice(slot.offset, slot.offset + slot.numel)
            shape = slot.param.shape
            model_sd[slot.name] = weights[span].view(shape).clone()
            optim_state[slot.name] = {k: v[span].view(shape).clone() for k, v in states.items()}
            optim_state[slot.name].update({k: _clone(v) for k, v in scalars.items()})
    tied = {}
    for name, value in strategy.model.state_dict(keep_vars=True).items():
        name = clean_name(name)
        if name not in model_sd:
            tied[name] = value
    for name, value in tied.items():  # buffers, and a tied weight's second name
        slot = strategy._slot_of.get(value)
        model_sd[name] = model_sd[slot.name] if slot is not None else value.detach().clone()
    groups = []
    names = _group_names(strategy)
    for g, group_names in zip(strategy.optimizer.param_groups, names, strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": group_names})
    return {
        "model": model_sd,
        "optimizer": {"state": optim_state, "param_groups": groups},
        "loss_scaler": strategy.scaler.state_dict(),
    }


def _clone(v):
    return v.clone() if torch.is_tensor(v) else v


def _group_names(strategy) -> list[list[str]]:
    """Parameter names per optimizer group, in the factory's order (as get_state_dict)."""
    out: list[list[str]] = [[] for _ in strategy.optimizer.param_groups]
    group_of = {
        id(t): i for i, g in enumerate(strategy.optimizer.param_groups) for t in g["params"]
    }
    for piece, tensor in strategy.piece_params:
        names = out[group_of[id(tensor)]]
        if piece.slot.name not in names:
            names.append(piece.slot.name)
    # Parameters with no piece on this rank still belong to a group: agree across ranks.
    gathered = [None] * strategy.world
    dist.all_gather_object(gathered, out, group=strategy.group)
    merged: list[list[str]] = [[] for _ in out]
    for rank_groups in gathered:
        for i, names in enumerate(rank_groups):
            merged[i].extend(n for n in names if n not in merged[i])
    return merged


def scatter_state(strategy, saved: dict) -> None:
    model_sd, optim = saved["model"], saved["optimizer"]
    with torch.no_grad():
        for buf in strategy.buffers:
            lo = buf.bucket.shard_range(strategy.rank)[0]
            for slot in buf.bucket.slots:
                whole = model_sd[slot.name].flatten()
                if strategy.stage < 3:
                    buf.full[slot.offset : slot.offset + slot.numel].copy_(whole)
            for piece, tensor in zip(buf.pieces, buf.piece_tensors, strict=True):
                a, b = piece.param_range
                whole = model_sd[piece.slot.name].flatten()
                tensor.copy_(whole[a:b])
                if buf.master is not buf.shard:
                    buf.shard[piece.start - lo : piece.stop - lo].copy_(whole[a:b])
                saved_state = optim["state"][piece.slot.name]
                current = strategy.optimizer.state.get(tensor, {})  # keeps each state's dtype
                strategy.optimizer.state[tensor] = {
                    k: (
                        v.flatten()[a:b].to(tensor.device, current.get(k, v).dtype, copy=True)
                        if torch.is_tensor(v) and v.dim()
                        else _clone(v)
                    )
                    for k, v in saved_state.items()
                }
        params = {id(slot.param) for buf in strategy.buffers for slot in buf.bucket.slots}
        for name, value in strategy.model.state_dict(keep_vars=True).items():
            if id(value) not in params and clean_name(name) in model_sd:
                value.data.copy_(model_sd[clean_name(name)])
    for g, saved_group in zip(strategy.optimizer.param_groups, optim["param_groups"], strict=True):
        g.update({k: v for k, v in saved_group.items() if k != "params"})
    strategy.scaler.load_state_dict(saved["loss_scaler"])
