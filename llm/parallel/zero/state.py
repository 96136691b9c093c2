"""ZeRO checkpoints in the layout every strategy shares, written and read without a gather.

Keys as torch DCP's ``get_state_dict`` lays them out: ``model.<name>`` at the parameter's own
shape, ``optimizer.state.<name>.<moment>`` and ``optimizer.param_groups`` (names, not
tensors), plus the loss scaler. Each parameter is a FlatShard (llm/parallel/flat_shards.py)
whose rectangles are views of this rank's piece: the fp32 master when one exists, else the
working shard, and the piece's optimizer moments. DCP writes each rank's pieces once, and a
load reads only the chunks that overlap them, from a checkpoint saved by any world size or
strategy, straight into place; nothing larger than one saved chunk is ever materialised.
A parameter of which this rank owns nothing is a FlatShard with no rectangles here.

Under tensor parallel a piece is a flat range of the rank's DTensor block, placed at that
block's offset in the whole parameter, so the keys and shapes are those of one process and
of tensor parallel's own DTensor checkpoints. The pieces of a tp-split parameter over the
ranks of its pipeline stage (the world without one) cover it once; a tp-replicated one
(norms, row-parallel biases) is covered by the dp group's pieces, and DCP writes the chunks
the tp peers share once.

Under expert parallel a rank's expert slice is a bucket set of its own cut over the edp
group (strategy.py); its pieces are placed at the slice's rows in the whole tensor (the
ep rank's first expert), so the keys and shapes are one process's and DCP reshards them to
another ep or edp size as it does any FlatShard.

After a load the 16-bit working shard is refreshed from the master, and under stages 1-2 the
working buffers are all-gathered (the working parameters, 2Φ, as after every step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llm.comm.collectives import all_gather
from llm.models import local_region, param_name
from llm.optim import materialize_state
from llm.parallel.flat_shards import FlatShard, flat_shard
from llm.parallel.tensor_parallel import tp_copies


def ensure_optimizer_state(strategy) -> None:
    """Create the lazily made optimizer state a checkpoint loads into, one bucket at a time
    (the zero-lr step's temporaries stay within one bucket)."""
    optimizer = strategy.optimizer
    group_of = {id(t): i for i, g in enumerate(optimizer.param_groups) for t in g["params"]}
    for buf in strategy.buffers + strategy.expert_buffers:
        missing = [(t, group_of[id(t)]) for t in buf.piece_tensors if t not in optimizer.state]
        if missing:
            materialize_state(optimizer, missing)


def _local_layout(strategy) -> tuple[list[list[str]], dict[str, dict]]:
    """This rank's view of the optimizer: parameter names per group, and per parameter its
    state keys by kind: ``moments`` (element-wise, the piece's shape: exp_avg, ...),
    ``whole`` (the whole parameter's, kept by every rank holding a piece: Adafactor's row
    and column statistics, bitsandbytes' quantisation maps), ``blocks`` (one value per
    quantisation block: 8-bit AdamW's absmaxes) and ``scalars`` (AdamW's ``step``) with
    their values."""
    optimizer = strategy.optimizer
    names: list[list[str]] = [[] for _ in optimizer.param_groups]
    group_of = {id(t): i for i, g in enumerate(optimizer.param_groups) for t in g["params"]}
    keys: dict[str, dict] = {}
    for piece, tensor in strategy.piece_params:
        group = names[group_of[id(tensor)]]
        if piece.slot.name not in group:
            group.append(piece.slot.name)
        kinds = keys.setdefault(piece.slot.name, _no_keys())
        for k, v in optimizer.state[tensor].items():
            if not (torch.is_tensor(v) and v.dim()):
                kinds["scalars"][k] = v.item() if torch.is_tensor(v) else v
            elif k not in kinds["moments"] + kinds["whole"] + kinds["blocks"]:
                kinds[_kind(k, v, tensor)].append(k)
    return names, keys


# bitsandbytes' state by name, since shapes can coincide (a 256-element piece and its
# 256-entry quantisation map): per-block absmaxes (absmax1, absmax2), one value per block of
# the piece, whose blocks are its parameter's (the buckets are aligned to them); and the
# quantisation maps (qmap1, qmap2), the same on every rank.
BLOCK_STATE, SHARED_STATE = "absmax", "qmap"


def _kind(key: str, value: torch.Tensor, piece: torch.Tensor) -> str:
    if key.startswith(BLOCK_STATE):
        return "blocks"
    if key.startswith(SHARED_STATE) or value.shape != piece.shape:
        return "whole"
    return "moments"


def _no_keys() -> dict:
    return {"moments": [], "whole": [], "blocks": [], "scalars": {}}


def _agreed_layout(strategy) -> tuple[list[list[str]], dict[str, dict]]:
    """The layout every rank must use, merged over ranks: a rank may own no piece of some
    parameter (or group, or of any parameter), yet every rank lists every parameter, moment
    and scalar, so that the FlatShard keys of every rank's state dict agree. (A ``whole``
    tensor is written by the ranks that hold it; DCP keeps one copy.)"""
    gathered = [None] * strategy.world
    dist.all_gather_object(gathered, _local_layout(strategy), group=strategy.group)
    names: list[list[str]] = [[] for _ in strategy.optimizer.param_groups]
    keys: dict[str, dict] = {}
    for rank_names, rank_keys in gathered:
        for merged, group in zip(names, rank_names, strict=True):
            merged.extend(n for n in group if n not in merged)
        for name, kinds in rank_keys.items():
            keys.setdefault(name, kinds)
    return names, keys


def _scalar(value):
    """A fresh copy per parameter: DCP loads into each entry separately."""
    return torch.tensor(value) if isinstance(value, float) else value


def _placed(strategy, slot) -> tuple[tuple, tuple[list[int], list[int]] | None]:
    """The whole parameter's shape, and where ``slot``'s bucketed block sits in it (None:
    it is the whole): tensor parallel's local block, or an expert slice's rows."""
    param, experts = slot.param, strategy.expert_shards
    if experts and experts.holds(param):
        return experts.whole_shape(param), experts.region(param)
    if not isinstance(param, DTensor) or tp_copies(param, strategy.dims.tp_size) > 1:
        return param.shape, None
    return param.shape, local_region(param)


def checkpoint_state(strategy) -> dict:
    """The state dict over this rank's own pieces (views; DCP loads into them in place)."""
    ensure_optimizer_state(strategy)
    group_names, keys = _agreed_layout(strategy)
    optimizer = strategy.optimizer
    model_sd, optim_state = {}, {}
    for buf in strategy.buffers + strategy.expert_buffers:
        if not buf.bucket.trainable:
            model_sd.update(_frozen_state(strategy, buf))
            continue
        owned = {p.slot.name: (p, t) for p, t in zip(buf.pieces, buf.piece_tensors, strict=True)}
        for slot in buf.bucket.slots:
            piece, tensor = owned.get(slot.name, (None, None))
            start = piece.param_range[0] if piece else 0
            state = optimizer.state[tensor] if piece else {}
            shape, block = _placed(strategy, slot)
            model_sd[slot.name] = flat_shard(shape, start, tensor, block)
            kinds = keys.get(slot.name, _no_keys())
            qb = strategy.quant_block
            blocks = (-(-shape.numel() // qb),)
            optim_state[slot.name] = _nested_as_bitsandbytes(
                optimizer,
                {k: flat_shard(shape, start, state.get(k), block) for k in kinds["moments"]}
                | {k: flat_shard(blocks, start // qb, state.get(k)) for k in kinds["blocks"]}
                | {k: state[k] for k in kinds["whole"] if piece}
                | {k: _scalar(v) for k, v in kinds["scalars"].items()},
            )
    for name, value in strategy.model.state_dict(keep_vars=True).items():
        name = param_name(name)
        if name not in model_sd:  # buffers, and a tied weight's second name
            slot = strategy._slot_of.get(value)
            model_sd[name] = model_sd[slot.name] if slot is not None else value.detach()
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(optimizer.param_groups, group_names, strict=True)
    ]
    return {
        "model": model_sd,
        "optimizer": {"state": optim_state, "param_groups": groups},
        "loss_scaler": strategy.scaler.state_dict(),
    }


def _nested_as_bitsandbytes(optimizer, entries: dict) -> dict:
    """bitsandbytes' state_dict nests its quantisation state (state1, absmax1, qmap1, ...)
    under one key per parameter; nested the same here, the keys are one process's and
    FSDP's, so a checkpoint moves between them."""
    nest = getattr(optimizer, "_FSDP_WRAPPED_QUANT_STATE_KEY", None)
    if nest is None:
        return entries
    inner = {k: v for k, v in entries.items() if k in optimizer.non_castable_tensor_keys}
    outer = {k: v for k, v in entries.items() if k not in inner}
    return outer | ({nest: inner} if inner else {})


def _frozen_state(strategy, buf) -> dict:
    """A frozen bucket's parameters: this rank's slice of the working shard (their only
    copy; no optimizer state), so other strategies and world sizes load them too."""
    lo = buf.bucket.shard_range(buf.rank)[0]
    owned = {p.slot.name: p for p in buf.bucket.pieces(buf.rank)}
    out = {}
    for slot in buf.bucket.slots:
        piece = owned.get(slot.name)
        local = buf.shard[piece.start - lo : piece.stop - lo] if piece else None
        start = piece.param_range[0] if piece else 0
        shape, block = _placed(strategy, slot)
        out[slot.name] = flat_shard(shape, start, local, block)
    return out


@torch.no_grad()
def restore_state(strategy, loaded: dict) -> None:
    """After DCP filled the pieces of ``checkpoint_state()``'s dict: scalars, param groups,
    the loss scaler, and the working parameters refreshed from the masters."""
    optimizer, states = strategy.optimizer, loaded["optimizer"]["state"]
    for piece, tensor in strategy.piece_params:
        state = optimizer.state[tensor]
        for k, v in states[piece.slot.name].items():
            if isinstance(v, FlatShard | dict) or (torch.is_tensor(v) and v.dim()):
                continue  # moments, whole tensors and bitsandbytes' nest: loaded in place
            held = state.get(k)
            state[k] = held.fill_(v) if torch.is_tensor(held) else _plain(v)
    for g, saved in zip(optimizer.param_groups, loaded["optimizer"]["param_groups"], strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
    for buf in strategy.buffers + strategy.expert_buffers:
        if buf.master is not buf.shard:
            buf.shard.copy_(buf.master)
        if strategy.stage < 3:  # stage 3 gathers from the shard in the next forward
            all_gather(buf.full, buf.shard, group=strategy.group_of(buf))
    strategy.scaler.load_state_dict(loaded["loss_scaler"])


def _plain(v):
    return v.item() if torch.is_tensor(v) else v
