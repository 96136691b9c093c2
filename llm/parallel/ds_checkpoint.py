"""DeepSpeed's partitioned training state in our checkpoint layout, world-size independent.

DeepSpeed keeps the fp32 master weights and Adam moments as flat buffers, one slice per rank,
cut without regard to parameter boundaries. We expose them under the keys every other
strategy writes (``model.<name>`` and ``optimizer.state.<name>.exp_avg`` at the parameter's
own shape, torch DCP's get_state_dict layout), each as a ShardedTensor whose local shards
are views into DeepSpeed's buffers: DCP saves them without a gather and loads (resharding
from any world size or strategy) straight into place.

A rank's slice of one parameter is a flat range [start, start + n) of the parameter; a
row-major range is a few rectangles (a partial first row, whole rows, a partial last row,
recursively), which is what a ShardedTensor's shards can describe.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

# torch 2.13 deprecates ShardedTensor for DTensor, but a DTensor shards evenly and cannot
# describe DeepSpeed's cuts; DCP still reads and writes ShardedTensors.
warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)


@dataclass
class Fragment:
    """This rank's elements [start, start + numel) of one flattened parameter, which live at
    ``offset`` in ``flat``, a parameter of DeepSpeed's inner torch optimizer."""

    start: int
    numel: int
    flat: torch.Tensor
    offset: int

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1).narrow(0, self.offset, self.numel)


def fragments(engine, inner: torch.optim.Optimizer) -> dict[str, Fragment | None]:
    """Parameter name -> this rank's fragment (None: another rank owns all of it)."""
    opt, out = engine.optimizer, {}
    flats = [f for f, _ in optimizer_flats(engine, inner)]
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3: rank r holds [r * n, (r + 1) * n), padded
            group, offset, n = opt.grad_position[opt.get_param_id(p)]
            start = opt._get_param_partition_rank(p) * n
            real = min(n, max(0, p.ds_numel - start))
            flat = opt.fp32_partitioned_groups_flat[group]
            out[name] = Fragment(start, real, flat, offset) if real else None
        elif engine.zero_optimization_stage() == 0:  # the parameter is its own master
            out[name] = Fragment(0, p.numel(), p, 0)
        elif (m := getattr(p, "_hp_mapping", None)) is not None:  # ZeRO-1/2: hp <-> lp map
            flat = _holder(m.hp_fragment, flats)
            lp, hp = m.lp_fragment_address, m.hp_fragment_address
            out[name] = Fragment(lp.start, lp.numel, flat, hp.start)
        else:
            out[name] = None
    return out


def _holder(view: torch.Tensor, flats: list[torch.Tensor]) -> torch.Tensor:
    """The flat buffer whose memory ``view`` lies in."""
    at = view.data_ptr()
    return next(f for f in flats if f.data_ptr() <= at < f.data_ptr() + f.nbytes)


def optimizer_flats(engine, inner) -> list[tuple[torch.Tensor, int]]:
    """(tensor the inner optimizer steps, its param-group index). ZeRO-3 fills the groups
    only while it steps each sub-group, so its flats are listed from the optimizer."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return [
            (flat, opt.sub_group_to_group_id[i])
            for i, flat in enumerate(opt.fp32_partitioned_groups_flat)
        ]
    return [(p, gi) for gi, g in enumerate(inner.param_groups) for p in g["params"]]


@torch.no_grad()
def materialize_optimizer_state(inner: torch.optim.Optimizer, flats) -> None:
    """Adam's moments exist only after a first step, and a checkpoint loads into them in
    place: create them as a step at lr 0 on zero gradients does (weights unchanged, its
    step count is overwritten by the load)."""
    if all(flat in inner.state for flat, _ in flats):
        return
    saved = [(g["params"], g["lr"]) for g in inner.param_groups]
    for g in inner.param_groups:
        g["params"], g["lr"] = [], 0.0
    for flat, gi in flats:
        inner.param_groups[gi]["params"].append(flat)
    grads = [flat.grad for flat, _ in flats]
    for flat, _ in flats:
        flat.grad = torch.zeros_like(flat)
    inner.step()
    for (flat, _), grad in zip(flats, grads, strict=True):
        flat.grad = grad
    for g, (params, lr) in zip(inner.param_groups, saved, strict=True):
        g["params"], g["lr"] = params, lr


def blocks(shape: tuple[int, ...], a: int, b: int) -> list[tuple[list[int], list[int]]]:
    """Row-major elements [a, b) of a tensor of ``shape`` as (offsets, sizes) rectangles, in
    order, so that consecutive blocks are consecutive slices of the flat range."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [([a], [b - a])]
    row = math.prod(shape[1:])
    inner = shape[1:]
    first, last = a // row, b // row  # rows holding a and b (b exclusive)
    if first == last:  # inside one row
        return [([first, *o], [1, *s]) for o, s in blocks(inner, a % row, b % row)]
    out = []
    if a % row:
        out += [([first, *o], [1, *s]) for o, s in blocks(inner, a % row, row)]
        first += 1
    if last > first:
        out.append(([first] + [0] * len(inner), [last - first, *inner]))
    if b % row:
        out += [([last, *o], [1, *s]) for o, s in blocks(inner, 0, b % row)]
    return out


def sharded(shape, frag: Fragment | None, flat: torch.Tensor, group) -> ShardedTensor:
    """A ShardedTensor of ``shape`` whose local shards are views of this rank's fragment in
    ``flat`` (the master weights or one of their optimizer states; with no fragment, any
    tensor of their dtype and device). Collective over ``group``."""
    place = f"rank:{dist.get_rank(group)}/{flat.device}"
    if frag is None:
        # One empty shard, not none: DCP's loader drops a key whose ShardedTensor has no
        # local shard, then takes the checkpoint for an old-format one and refuses it. It
        # sits past the last row: DCP's save dedups chunks by offset, and one at the origin
        # would replace the real shard that starts there.
        sizes = [0, *shape[1:]]
        empty = flat.detach().new_empty(sizes)
        shards = [Shard(empty, ShardMetadata([shape[0]] + [0] * (len(shape) - 1), sizes, place))]
        return init_from_local_shards(shards, *shape, process_group=group)
    shards, pos, data = [], 0, frag.view(flat)
    for offsets, sizes in blocks(tuple(shape), frag.start, frag.start + frag.numel):
        n = math.prod(sizes)
        shard = data.narrow(0, pos, n).view(sizes)
        shards.append(Shard(shard, ShardMetadata(offsets, sizes, place)))
        pos += n
    return init_from_local_shards(shards, *shape, process_group=group)


def checkpoint_state(engine, inner, group_names: list[list[str]], group, shard: bool) -> dict:
    """The model and optimizer as get_state_dict lays them out, over DeepSpeed's buffers:
    ``model.<name>`` are the fp32 masters, ``optimizer.state.<name>.<moment>`` their moments
    (views: DCP loads into them in place), scalars and param groups are copies."""
    flats = optimizer_flats(engine, inner)
    materialize_optimizer_state(inner, flats)
    frags = fragments(engine, inner)
    any_flat = flats[0][0]
    first = inner.state[any_flat]
    moments = sorted(
        k for k, v in first.items() if torch.is_tensor(v) and v.shape == any_flat.shape
    )
    scalars = {"step": torch.tensor(float(first["step"]))} if "step" in first else {}

    def entry(f: Fragment | None, shape, key: str | None):  # key None: the master itself
        flat = f.flat if f else any_flat
        tensor = flat if key is None else inner.state[flat][key]
        return sharded(shape, f, tensor, group) if shard else f.view(tensor).view(shape)

    model, states = {}, {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            # Frozen (model.freeze; refused at stage 3): no master and no state, a whole
            # replica on every rank, saved once and loaded in place.
            model[name] = p.detach()
            continue
        shape, f = getattr(p, "ds_shape", p.shape), frags[name]  # ZeRO-3 empties p.data
        model[name] = entry(f, shape, None)
        states[name] = {k: entry(f, shape, k) for k in moments} | scalars
    # Tied weights are one parameter under two names; both are saved, as other strategies do.
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        model.setdefault(name, model[names[id(p)]])
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": params}
        for g, params in zip(inner.param_groups, group_names, strict=True)
    ]
    return {"model": model, "optimizer": {"state": states, "param_groups": groups}}


def restore(engine, inner, saved_optimizer: dict) -> None:
    """After DCP filled the views: the step counts, the param groups (lr included: our
    scheduler only rewrites it after the next step), and the working weights."""
    saved = next(iter(saved_optimizer["state"].values()))
    for flat, _ in optimizer_flats(engine, inner):
        state = inner.state[flat]
        if "step" in saved:
            held = state["step"]
            state["step"] = (
                held.fill_(float(saved["step"])) if torch.is_tensor(held) else int(saved["step"])
            )
    for group, loaded in zip(inner.param_groups, saved_optimizer["param_groups"], strict=True):
        group.update({k: v for k, v in loaded.items() if k != "params" and k in group})
    opt = engine.optimizer
    if engine.zero_optimization_stage() in (1, 2):
        opt.update_lp_params()  # masters into the working partition, then all-gathered
    elif engine.zero_optimization_stage() == 3:
        for lp, hp in zip(
            opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat, strict=True
        ):
            lp.data.copy_(hp.data)
        opt.checkpoint_event_epilogue()  # re-gathers the persistent (whole) parameters
