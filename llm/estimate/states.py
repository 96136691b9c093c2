"""Bytes of parameters, gradients and optimizer states one rank holds, by strategy, from
parameter shapes alone (a meta-device model): the figures ``strategy.memory()`` reports
after a step (its ``state_tensors()``, which the peak tracker classifies by).

Our ZeRO's figures come from the layout the strategy itself builds
(``llm.parallel.zero.layout.model_buckets``); FSDP2's from its dim-0 sharding (each rank's
storage padded to ceil(rows/N) rows, the optimizer's states of the unpadded local rows);
optimizer states from each optimizer's own declaration (``OPTIMIZERS[name].state_bytes``).
DeepSpeed's are the ZeRO paper's arithmetic (``paper_states``): neither its buffers' sizes
nor its own estimators' figures, which add an fp32 gradient partition and, at stage 3, a
largest-layer buffer (2Φ + 18Φ/N and 4·L + 18Φ/N against our 2Φ + 14Φ/N and 16Φ/N for
Adam; ``llm.estimate.deepspeed_own``, printed beside ours by ``python -m llm.estimate``).

With tensor parallel (``parallelism.tp_size``) every figure is of the rank's local blocks
(``tp_local_shapes``: tensor parallel's split read off its plan), sharded over the dp size
world / (tp * pp), as the strategies shard them. Under pipeline parallel ``model`` is the
rank's ``PipelinePart`` (a tied head copy on the last stage is a parameter of its own, and
our ZeRO buckets it alone, as the strategy does).

Offload moves rows off the device: ``offload_optimizer=cpu`` the master and moments to host
memory; ``nvme`` to files (``disk``), leaving in host memory the pool the step streams them
through (three buffers of the largest bucket's master and moments); under stage 3
``offload_params=nvme`` the parameter shards go to files as well, and host memory keeps the
four-unit read-ahead pool (llm/parallel/zero/nvme/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from llm.config import OptimizerConfig, ParallelismConfig
from llm.models.moe import Experts
from llm.optim import OPTIMIZERS, optimizer_param_groups, pieces_state_bytes
from llm.parallel.pipeline import PipelinePart
from llm.parallel.tensor_parallel import tp_local_shapes
from llm.parallel.zero.layout import model_buckets
from llm.parallel.zero.nvme.direct_file import aligned
from llm.parallel.zero.nvme.optimizer_swap import SLOTS as OPTIMIZER_SLOTS
from llm.parallel.zero.nvme.param_swap import SLOTS as PARAM_SLOTS
from llm.precision import PrecisionPolicy

KINDS = ("params", "grads", "optimizer_states")


@dataclass
class RankStates:
    """Device bytes by category, what an offload moves to host memory, and to nvme files."""

    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    host: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    disk: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @property
    def total(self) -> int:
        return sum(self.device.values())


def _kinds(model: nn.Module, opt: OptimizerConfig) -> dict[int, str]:
    """id(parameter) -> its param group's kind, as the optimizer will group it
    (llm.optim.factory: "matrix", "vector", and Muon's "hidden")."""
    return {id(p): g["kind"] for g in optimizer_param_groups(model, opt) for p in g["params"]}


def _opt_bytes(
    cfg: OptimizerConfig, shapes: list[tuple[tuple[int, ...], str, tuple[int, ...]]]
) -> int:
    """``(held shape, group kind, whole shape)``: the optimizer's state for what a rank
    holds of each parameter (whole-matrix and 8-bit rules read the whole shape)."""
    return pieces_state_bytes(cfg, [(held, whole, kind) for held, kind, whole in shapes])


def model_states(
    model: nn.Module,
    par: ParallelismConfig,
    policy: PrecisionPolicy,
    opt: OptimizerConfig,
    world: int,
    rank: int = 0,
) -> RankStates:
    """What rank ``rank`` of ``world`` holds under ``par.name`` (deepspeed: ``par.zero_stage``)."""
    experts = _expert_slices(model) if par.ep_size > 1 else []
    expert_ids = {id(x) for x in experts}
    params = [p for p in model.parameters() if id(p) not in expert_ids]  # a tied weight once
    tp = par.tp_size
    dp = world // (tp * par.pp_size)
    dp_rank = (rank // tp) % dp
    shapes = tp_local_shapes(model, tp, rank % tp)
    kinds = _kinds(model, opt)
    if par.name in ("single", "ddp"):
        out = _replica(params, shapes, policy, opt, kinds)
    elif par.name == "fsdp":  # HSDP shards within each of the replicate groups
        shard = dp // par.replicate
        offload = par.offload_params == "cpu"
        out = _fsdp(params, shapes, policy, opt, kinds, shard, dp_rank % shard, offload)
    elif par.name in ("zero1", "zero2", "zero3"):
        out = _zero(model, shapes, par, policy, opt, kinds, dp, dp_rank, frozenset(experts))
    else:
        n = sum(p.numel() for p in params)
        offload = (par.offload_optimizer, par.offload_params)
        return paper_states(n, world, par.zero_stage, policy, opt, *offload)
    if experts:  # each rank's E / ep experts beside the strategy's states
        local = {x: torch.Size((x.shape[0] // par.ep_size, *x.shape[1:])) for x in experts}
        edp, edp_rank = dp // par.ep_size, dp_rank // par.ep_size
        if par.name in ("zero1", "zero2", "zero3"):  # a second set of buckets, cut over edp
            extra = _zero_experts(model, experts, local, par, policy, opt, kinds, edp, edp_rank)
        elif par.name == "fsdp" and edp > 1:  # each slice sharded again over its edp ranks
            extra = _fsdp(
                experts,
                local,
                policy,
                opt,
                kinds,
                edp,
                edp_rank,
                par.offload_params == "cpu",
            )
        else:  # whole on each rank of the edp group
            extra = _replica(experts, local, policy, opt, kinds)
        for kind in KINDS:
            out.device[kind] += extra.device[kind]
            out.host[kind] += extra.host[kind]
            out.disk[kind] += extra.disk[kind]
    return out


def _expert_slices(model: nn.Module) -> list[nn.Parameter]:
    """The MoE experts' stacked weights: under expert parallelism each rank holds its slice,
    apart from the strategy's dense sharding (llm/parallel/experts/): whole (ddp), or under
    fsdp and our zero1-3 sharded again over the edp ranks."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


def _replica(
    params: list[nn.Parameter], shapes, policy: PrecisionPolicy, opt: OptimizerConfig, kinds
):
    p = policy.param_dtype.itemsize
    trainable = [x for x in params if x.requires_grad]
    out = RankStates()
    out.device["params"] = p * sum(shapes[x].numel() for x in params)
    out.device["grads"] = p * sum(shapes[x].numel() for x in trainable)
    held = [(tuple(shapes[x]), kinds[id(x)], tuple(shapes[x])) for x in trainable]
    out.device["optimizer_states"] = _opt_bytes(opt, held)
    return out


def fsdp_local_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of ``rows`` on ``rank``: (rows it holds, rows its storage has,
    padded to ceil(rows/N))."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk)), chunk


def _fsdp(params, shapes, policy, opt, kinds, world: int, rank: int, offload: bool) -> RankStates:
    """FSDP2 shards dim 0 of what a rank holds: the tp-local block under tensor parallel."""
    p = policy.param_dtype.itemsize
    out = RankStates()
    where = out.host if offload else out.device
    held_shapes = []
    for x in params:
        local = shapes[x]
        held, padded = fsdp_local_rows(local[0], world, rank)
        inner = math.prod(local[1:])
        where["params"] += p * padded * inner
        if x.requires_grad:
            where["grads"] += p * padded * inner
            held_shapes.append(((held, *local[1:]), kinds[id(x)], tuple(local)))
    where["optimizer_states"] += _opt_bytes(opt, held_shapes)
    return out


def _zero(
    model,
    shapes,
    par: ParallelismConfig,
    policy,
    opt,
    kinds,
    world: int,
    rank: int,
    skip: frozenset = frozenset(),
) -> RankStates:
    """Mirrors llm/parallel/zero/buffers.py after a step, before zero_grad: the working
    buffers (stage 3: only the shard; gathered units are freed), the fp32 gradient shard
    (stage 1 also the persistent working-dtype bucket), the master when it is a separate
    copy, and the optimizer's state of each piece of the rank's slice."""
    stage = int(par.name[-1])
    w = policy.working_dtype.itemsize
    alone = model.tied_half() if isinstance(model, PipelinePart) else None
    align = OPTIMIZERS[opt.name].quant_block or 1  # 8-bit AdamW: blocks never straddle a cut
    buckets = model_buckets(
        model, stage, par.bucket_cap_mb, w, world, shapes.__getitem__, alone, align, skip
    )
    return _zero_buckets(buckets, par, policy, opt, kinds, rank)


def _zero_experts(
    model, experts, local, par: ParallelismConfig, policy, opt, kinds, edp: int, edp_rank: int
) -> RankStates:
    """Our ZeRO's expert slices (llm/parallel/zero/strategy.py): their own buckets of the
    rank's ``local`` slice shapes, cut over the ``edp`` ranks that hold the same experts."""
    buckets = model_buckets(
        model,
        int(par.name[-1]),
        par.bucket_cap_mb,
        policy.working_dtype.itemsize,
        edp,
        local.__getitem__,
        align=OPTIMIZERS[opt.name].quant_block or 1,
        only=frozenset(experts),
    )
    return _zero_buckets(buckets, par, policy, opt, kinds, edp_rank, experts=True)


def _zero_buckets(
    buckets, par: ParallelismConfig, policy, opt, kinds, rank: int, experts: bool = False
) -> RankStates:
    """:func:`_zero`'s count over one set of buckets, as rank ``rank`` of the group they
    are cut over. ``experts``: the expert slices' set (strategy.py keeps it on the device,
    whatever the offload of the dense set)."""
    stage = int(par.name[-1])
    w, m = policy.working_dtype.itemsize, policy.master_dtype.itemsize
    offload = "none" if experts else par.offload_optimizer
    params_at = "none" if experts else par.offload_params
    nvme = "nvme" in (offload, params_at)
    separate = policy.master_dtype != policy.working_dtype or offload != "none" or nvme
    out = RankStates()
    opt_where = {"none": out.device, "cpu": out.host, "nvme": out.disk}[offload]
    shard_where = {"none": out.device, "cpu": out.host, "nvme": out.disk}[params_at]
    shapes = []
    for b in buckets:
        if stage == 3:
            shard_where["params"] += w * b.shard
        else:
            out.device["params"] += w * b.padded
        if not b.trainable:
            continue
        out.device["grads"] += m * b.shard + (w * b.padded if stage == 1 else 0)
        if offload != "none":  # the master's gradient, on the host
            out.host["grads"] += m * b.shard
        if separate:
            opt_where["optimizer_states"] += m * b.shard
        for piece in b.pieces(rank):
            kind = kinds[id(piece.slot.param)]
            shapes.append(((piece.stop - piece.start,), kind, tuple(piece.slot.shape)))
    opt_where["optimizer_states"] += _opt_bytes(opt, shapes)
    if offload == "nvme":
        out.host["optimizer_states"] += _optimizer_pool(buckets, m, opt)
    if stage == 3 and params_at == "nvme":
        out.host["params"] += _param_pool(buckets, w)
    return out


def _optimizer_pool(buckets, itemsize: int, opt: OptimizerConfig) -> int:
    """nvme/optimizer_swap.py's buffers: three slots, each the largest bucket's shard once
    for the master and once per moment (page-aligned)."""
    stride = max((aligned(b.shard * itemsize) for b in buckets if b.trainable), default=0)
    probe = 1 << 20  # per-element state, the per-tensor step count diluted away
    moments = OPTIMIZERS[opt.name].state_bytes((probe,), "matrix", opt) // (probe * itemsize)
    return OPTIMIZER_SLOTS * stride * (1 + moments)


def _param_pool(buckets, itemsize: int) -> int:
    """nvme/param_swap.py's buffers: four slots of the widest unit's shards, and one bucket's
    staging buffer for the step's writes."""
    units: dict[int, int] = {}
    for b in buckets:
        units[b.unit] = units.get(b.unit, 0) + aligned(b.shard * itemsize)
    staging = max((aligned(b.shard * itemsize) for b in buckets), default=0)
    return PARAM_SLOTS * max(units.values(), default=0) + staging


def paper_states(
    n_params: int,
    world: int,
    stage: int,
    policy: PrecisionPolicy,
    opt: OptimizerConfig,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> RankStates:
    """The ZeRO paper's per-rank model states (Rajbhandari et al. 2020, section 3.1):
    16-bit params and grads (2Φ each), K·Φ of optimizer states (K = fp32 master + the
    optimizer's own state per element: 12 for Adam), partitioned by stage over N ranks; an
    offload moves the optimizer states (and, under stage 3, the parameters) to host memory
    (cpu) or files (nvme)."""
    w = policy.working_dtype.itemsize
    k = (policy.master_dtype.itemsize if w < 4 else 0) + OPTIMIZERS[opt.name].state_bytes(
        (n_params,), "matrix", opt
    ) / max(1, n_params)
    n = world
    params = w * n_params / (n if stage >= 3 else 1)
    grads = w * n_params / (n if stage >= 2 else 1)
    states = k * n_params / (n if stage >= 1 else 1)
    out = RankStates()
    out.device["grads"] = round(grads)
    where = {"none": out.device, "cpu": out.host, "nvme": out.disk}
    where[offload_params if stage == 3 else "none"]["params"] = round(params)
    where[offload_optimizer]["optimizer_states"] = round(states)
    return out
