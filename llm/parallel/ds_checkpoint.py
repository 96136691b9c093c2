"""DeepSpeed's partitioned training state in our checkpoint layout, world-size independent.

DeepSpeed keeps the fp32 master weights and Adam moments as flat buffers, one slice per rank,
cut without regard to parameter boundaries. We expose them under the keys every other
strategy writes (``model.<name>`` and ``optimizer.state.<name>.exp_avg`` at the parameter's
own shape, torch DCP's get_state_dict layout), each as a FlatShard whose rectangles are
views into DeepSpeed's buffers: DCP saves them without a gather and loads (resharding
from any world size or strategy) straight into place.

A rank's slice of one parameter is a flat range [start, start + n) of the parameter, a few
rectangles of it (llm/parallel/flat_shards.py, shared with our ZeRO's checkpoints).

DeepSpeed 0.19.8's public local accessors (``deepspeed.utils.safe_get_local_fp32_param``,
``safe_get_local_optimizer_state`` and their setters) exist for ZeRO-3 only, and return
``.to(accelerator)`` of the partition: a copy when the optimizer is offloaded, which would put
every local master and moment on the GPU at once while saving. The ``safe_get_full_*`` ones
all-reduce a whole parameter. So the fragments are found through the optimizer's flat
buffers (docs/zero.md lists the private attributes used and why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from llm.optim import materialize_state
from llm.parallel.flat_shards import flat_shard


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
        if not p.requires_grad:
            continue  # frozen: in no optimizer group, so no master (see checkpoint_state)
        if hasattr(p, "ds_tensor"):  # ZeRO-3: rank r holds [r * n, (r + 1) * n), padded
            group, offset, n = opt.grad_position[opt.get_param_id(p)]
            start = dist.get_rank(p.ds_process_group) * n
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


def checkpoint_state(engine, inner, group_names: list[list[str]], shard: bool) -> dict:
    """The model and optimizer as get_state_dict lays them out, over DeepSpeed's buffers:
    ``model.<name>`` are the fp32 masters, ``optimizer.state.<name>.<moment>`` their moments
    (views: DCP loads into them in place), scalars and param groups are copies."""
    flats = optimizer_flats(engine, inner)
    missing = [(flat, gi) for flat, gi in flats if flat not in inner.state]
    if missing:  # Adam's moments exist only after a first step; a load writes into them
        materialize_state(inner, missing)
    frags = fragments(engine, inner)
    # Per param group: its moments and scalars (DeepSpeed's Muon keeps a momentum_buffer on
    # its Muon groups' flats and Adam's moments and step on the others).
    moments, scalars = {}, {}
    for flat, gi in flats:
        state = inner.state[flat]
        moments.setdefault(
            gi, sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape)
        )
        scalars.setdefault(
            gi, {"step": torch.tensor(float(state["step"]))} if "step" in state else {}
        )
    group_of = {name: gi for gi, names in enumerate(group_names) for name in names}

    def entry(f: Fragment | None, shape, key: str | None):  # key None: the master itself
        if f is None:  # this rank holds none of it (sharded only)
            return flat_shard(shape, 0, None)
        tensor = f.flat if key is None else inner.state[f.flat][key]
        return flat_shard(shape, f.start, f.view(tensor)) if shard else f.view(tensor).view(shape)

    model, states = {}, {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            model[name] = _frozen(p, shard)
            continue
        shape, f = getattr(p, "ds_shape", p.shape), frags[name]  # ZeRO-3 empties p.data
        model[name] = entry(f, shape, None)
        gi = group_of[name]
        states[name] = {k: entry(f, shape, k) for k in moments[gi]} | scalars[gi]
    # Tied weights are one parameter under two names; both are saved, as other strategies do.
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        model.setdefault(name, model[names[id(p)]])
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": params}
        for g, params in zip(inner.param_groups, group_names, strict=True)
    ]
    return {"model": model, "optimizer": {"state": states, "param_groups": groups}}


def _frozen(p: torch.nn.Parameter, shard: bool):
    """A frozen parameter (model.freeze) has no master and no state. Stages 0-2: a whole
    replica on every rank, saved once and loaded in place. Stage 3 partitions it like the
    others, in the working dtype: rank r's [r * n, (r + 1) * n) of it, padded, is
    ``p.ds_tensor`` (loaded in place; a dtype differing from the checkpoint's is cast)."""
    if not hasattr(p, "ds_tensor"):
        return p.detach()
    n = p.ds_tensor.numel()
    start = dist.get_rank(p.ds_process_group) * n
    real = min(n, max(0, p.ds_numel - start))
    local = p.ds_tensor.detach().view(-1).narrow(0, 0, real)
    if not shard:
        return local.view(p.ds_shape)  # one rank holds it all
    return flat_shard(p.ds_shape, start, local)


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
