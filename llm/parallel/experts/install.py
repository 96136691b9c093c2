"""Expert parallelism put in place: every MoE layer given its exchange, and its experts cut
to this rank's slices (read from a weight source, or from the layer's own values)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llm.models.moe import MoE
from llm.models.weights import WeightSource
from llm.parallel.experts.exchange import AllToAllExchange, DataParallelExchange
from llm.parallel.experts.shards import ExpertShards


def expert_range(n_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """The experts ep rank ``ep_rank`` holds."""
    local = n_experts // ep
    return ep_rank * local, (ep_rank + 1) * local


def expert_mesh(device_type: str, world: int, ep: int) -> DeviceMesh:
    """(edp, ep) over the data-parallel ranks: ep groups are neighbouring ranks, ranks at
    the same place in every group form an edp group (they hold the same experts)."""
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))


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
            module.exchange = DataParallelExchange(dp_group)
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
