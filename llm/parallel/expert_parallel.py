"""Expert parallelism: each MoE layer's experts split over ``ep_size`` ranks, tokens moved to
their experts' ranks and back with ``all_to_all_single`` (DeepSpeed-MoE, GShard).

Ranks ``[g * ep, (g + 1) * ep)`` of the data-parallel group form expert-parallel group g;
rank ``i`` of a group holds experts ``[i * E / ep, (i + 1) * E / ep)``. Ranks with the same
place in different groups hold the same experts (the expert-data-parallel group, world /
ep ranks), and their expert gradients are summed over that group alone.

Per MoE layer and micro-batch (llm/models/moe.py hands over the assignments sorted by
expert, so each destination's rows are one run):
- counts: one all-gather of the (E,) assignment counts over the data-parallel group, so the
  balance loss and the capacity see the global micro-batch, as one process does;
- dispatch: the (ep, E/ep) counts of what each rank sends each expert, exchanged with one
  all_to_all_single, then the rows, with per-rank split sizes (gloo takes uneven splits);
- combine: the expert outputs back the same way. Backward runs each exchange in reverse.

Bytes sent to other ranks are counted (``take_sent``): rows that leave the rank, times
d_model, times the element size, for dispatch and combine, forward and backward.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from llm.models.moe import Experts, MoE
from llm.models.weights import WeightSource


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group, sent: Counter) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.sent = send, recv, group, sent
        return _exchange(x, send, recv, group, sent)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.sent), *[None] * 4


def _exchange(x: Tensor, send: list[int], recv: list[int], group, sent: Counter) -> Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x, recv, send, group=group)
    me = dist.get_rank(group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent["all_to_all"] += (sum(send) - send[me]) * row_bytes
    return out


class DataParallelCounts:
    """Every expert here, tokens spread over ``group``: counts summed over it."""

    def __init__(self, group) -> None:
        self.group = group
        self.sent: Counter[str] = Counter()

    def count(self, counts: Tensor) -> tuple[Tensor, Tensor]:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        every = counts.new_empty(world * counts.numel())
        dist.all_gather_into_tensor(every, counts.contiguous(), group=self.group)
        every = every.view(world, counts.numel())
        self.sent["all_gather"] += counts.numel() * counts.element_size()
        return every.sum(0), every[:rank].sum(0)

    def run(self, experts: Experts, x: Tensor, counts: Tensor) -> Tensor:
        return experts(x, counts)

    def take_sent(self) -> dict[str, int]:
        sent, self.sent = dict(self.sent), Counter()
        return sent


class AllToAllExchange(DataParallelCounts):
    """This rank's E / ep experts; the rows of every other expert go to its rank."""

    def __init__(self, dp_group, ep_group, n_experts: int) -> None:
        super().__init__(dp_group)
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.local = n_experts // self.ep

    def run(self, experts: Experts, x: Tensor, counts: Tensor) -> Tensor:
        """x: rows sorted by global expert, ``counts`` (E,) of each; returns their outputs."""
        per_rank = counts.view(self.ep, self.local)  # what this rank sends each expert
        received = torch.empty_like(per_rank)  # (source rank, local expert)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.ep_group)
        # The all-to-all takes its split sizes as host lists: one read per layer for all of
        # them, the experts' row counts with them (a kernel without row offsets needs them).
        on_host = torch.cat([per_rank.sum(1), received.sum(1), received.sum(0)]).tolist()
        send, recv = on_host[: self.ep], on_host[self.ep : 2 * self.ep]
        rows = _AllToAll.apply(x, send, recv, self.ep_group, self.sent)
        # Received runs are (source, expert); the experts want (expert, source).
        order = _regroup(received, sum(recv))
        y = experts(rows[order], received.sum(0), on_host[2 * self.ep :])
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], recv, send, self.ep_group, self.sent)


def _regroup(runs: Tensor, total: int) -> Tensor:
    """Row order that turns runs laid out (source, expert) into (expert, source); ``total``
    rows in all (known on the host)."""
    sizes = runs.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    by_expert = torch.arange(sizes.numel(), device=runs.device).view(runs.shape).t().reshape(-1)
    size, start = sizes[by_expert], starts[by_expert]
    new_start = torch.cumsum(size, 0) - size
    shift = torch.repeat_interleave(start - new_start, size, output_size=total)
    return torch.arange(total, device=runs.device) + shift


def expert_range(n_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """The experts ep rank ``ep_rank`` holds."""
    local = n_experts // ep
    return ep_rank * local, (ep_rank + 1) * local


def expert_mesh(device_type: str, world: int, ep: int) -> DeviceMesh:
    """(edp, ep) over the data-parallel ranks: ep groups are neighbouring ranks, ranks at
    the same place in every group form an edp group (they hold the same experts)."""
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))


class ExpertShards:
    """The expert parameters of an expert-parallel model: this rank's slices, plain tensors
    the optimizer steps like any other. They differ between ep ranks, so a strategy
    - leaves their gradients to :meth:`reduce_grads` (summed over the edp ranks that hold
      the same experts, divided by the dp size as every other gradient is averaged);
    - counts each of their gradient elements on edp ranks, not dp (:meth:`replicas`);
    - checkpoints them as DTensors on the (edp, ep) mesh, Replicate x Shard(0), through
      :meth:`to_checkpoint` / :meth:`from_checkpoint`, so DCP reshards them to another
      ep size or to one process, as it does any DTensor."""

    def __init__(self, params: dict[str, nn.Parameter], mesh: DeviceMesh, dp_size: int) -> None:
        self.params = params
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.edp_group = mesh["edp"].get_group()
        # Taken once: slicing the mesh builds a DeviceMesh, which reads its rank tensor.
        self.edp = mesh["edp"].size()
        self.dp_size = dp_size
        self._ids = {id(p) for p in params.values()}
        self.sent: Counter[str] = Counter()

    def holds(self, param: Tensor) -> bool:
        return id(param) in self._ids

    def replicas(self) -> int:
        """Ranks holding one expert gradient element once reduced: its edp group."""
        return self.dp_size // self.ep

    @torch.no_grad()
    def reduce_grads(self, count: bool = False) -> None:
        for param in self.params.values():
            if param.grad is None:
                continue
            param.grad.div_(self.dp_size)
            if self.edp > 1:
                dist.all_reduce(param.grad, group=self.edp_group)
                if count:
                    self.sent["all_reduce"] += param.grad.numel() * param.grad.element_size()

    def take_sent(self) -> dict[str, int]:
        sent, self.sent = dict(self.sent), Counter()
        return sent

    def as_dtensor(self, local: Tensor) -> DTensor:
        shape = (local.shape[0] * self.ep, *local.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride
        )

    def to_checkpoint(self, state: dict) -> dict:
        """``state`` ({"model", "optimizer"} as get_state_dict makes them) with every expert
        tensor, and each optimizer state tensor that has an expert's leading dimension, as a
        DTensor viewing the same storage (DCP's load writes into the parameter itself)."""
        model = dict(state["model"])
        optim = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
        for name, param in self.params.items():
            model[name] = self.as_dtensor(model[name])
            if name in optim["state"]:
                optim["state"][name] = self.state_entry(optim["state"][name], param)
        return {**state, "model": model, "optimizer": optim}

    def state_entry(self, state: dict, param: Tensor) -> dict:
        """An expert's optimizer state for a checkpoint: tensors with the slice's leading
        (experts) dimension as DTensors, the rest (AdamW's step) as they are."""
        return {
            key: self.as_dtensor(v) if _leads_with(v, param.shape[0]) else v
            for key, v in state.items()
        }

    def from_checkpoint(self, state: dict) -> dict:
        """The inverse of :meth:`to_checkpoint`: the expert entries local tensors again (a
        strategy's own DTensors, FSDP's shards, stay as they are)."""

        def local(name: str, v):
            return v.to_local() if name in self.params and isinstance(v, DTensor) else v

        model = {k: local(k, v) for k, v in state["model"].items()}
        optim = {**state["optimizer"], "state": {
            name: {key: local(name, v) for key, v in entry.items()}
            for name, entry in state["optimizer"]["state"].items()
        }}  # fmt: skip
        return {**state, "model": model, "optimizer": optim}


def _leads_with(value, experts: int) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == experts


def install(
    model: nn.Module,
    dp_group,
    mesh: DeviceMesh | None = None,
    weights: WeightSource | None = None,
    device: torch.device | None = None,
) -> ExpertShards | None:
    """Give every MoE layer of ``model`` its exchange. With an (edp, ep) ``mesh`` of ep > 1,
    cut each layer's experts to this rank's, read from ``weights`` on ``device`` (or from
    the layer's own values when the model is materialised), and return them as
    :class:`ExpertShards`; None without expert parallelism."""
    ep_group = mesh["ep"].get_group() if mesh is not None and mesh["ep"].size() > 1 else None
    shards: dict[str, nn.Parameter] = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        if ep_group is None:
            module.exchange = DataParallelCounts(dp_group)
            continue
        n_experts = module.moe.n_experts
        module.exchange = AllToAllExchange(dp_group, ep_group, n_experts)
        lo, hi = expert_range(n_experts, dist.get_world_size(ep_group), dist.get_rank(ep_group))
        for w in ("w1", "w3", "w2"):
            param = getattr(module.experts, w)
            if weights is not None:
                value = weights.rows(f"{name}.experts.{w}", lo, hi, device)
            else:
                value = param.detach()[lo:hi]
            # A storage of its own: a source's rows may view the whole tensor.
            value = value.to(param.dtype, copy=True)
            local = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(module.experts, w, local)
            shards[f"{name}.experts.{w}"] = local
    if ep_group is None:
        return None
    return ExpertShards(shards, mesh, dist.get_world_size(dp_group))
