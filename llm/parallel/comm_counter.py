"""Count the bytes of collectives that a library issues itself (FSDP2 here), per kind.
Installed only with ``parallelism.count_comm``; otherwise FSDP2 runs its own collectives.

Payload convention, shared with ddp.py's count: the full-size tensor each collective works
on, per rank: the all-gather OUTPUT, the reduce-scatter INPUT, the all-reduce buffer. A ring
implementation sends (N-1)/N of that payload per rank for all-gather and reduce-scatter and
2(N-1)/N for all-reduce, N being the size of the group the collective runs on.

How FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) can be
counted without patching ``torch.distributed``:
- parameter all-gathers and gradient reduce-scatters go through pluggable comm objects
  (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``); the counting ones
  below record the payload and then make the same calls as FSDP2's defaults (torch 2.13's
  ``dist.*_single``, older releases' ``all_gather_into_tensor``/``reduce_scatter_tensor``),
  allocating their buffers the same way (``torch.empty``);
- HSDP's all-reduce across replicas is a plain ``dist.all_reduce`` inside FSDP2, after which
  FSDP2 calls the module's ``set_all_reduce_hook`` hook with the all-reduced buffer. In plain
  FSDP that hook sees the reduce-scatter output instead, so it is installed for HSDP only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

# The interfaces set_custom_all_gather/_reduce_scatter take; torch 2.13 exports them nowhere else.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from llm.comm.collectives import all_gather, reduce_scatter
from llm.comm.sent import CommCounter


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(AllGather):
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype, device):
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.add("all_gather", output_tensor)
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype, device):
        return _empty(size, dtype, device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.add("reduce_scatter", input_tensor)
        return reduce_scatter(
            output=output_tensor, input=input_tensor, op=op, group=group, async_op=async_op
        )


def count_fsdp_collectives(model: nn.Module, counter: CommCounter, hsdp: bool) -> None:
    """Route every FSDP2 module's collectives in ``model`` through ``counter``."""
    all_gather, reduce_scatter = CountingAllGather(counter), CountingReduceScatter(counter)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
            if hsdp:
                module.set_all_reduce_hook(counter.all_reduce_hook)


_FUNCOL = torch.ops._c10d_functional
# DTensor's collectives (torch.distributed._functional_collectives): how many of their
# arguments name the group, and what their payload is, by the convention above.
_FUNCTIONAL_KINDS = {
    _FUNCOL.all_reduce.default: "all_reduce",
    _FUNCOL.all_reduce_.default: "all_reduce",
    _FUNCOL.all_gather_into_tensor.default: "all_gather",
    _FUNCOL.reduce_scatter_tensor.default: "reduce_scatter",
}


class MeshCommCounter(TorchDispatchMode):
    """While active, counts the payload of every functional collective (what DTensor's
    redistributions and ``loss_parallel`` issue, in forward and in backward) by the mesh
    dimension whose group it runs on: ``{"tp.all_reduce": bytes, ...}``."""

    def __init__(self, mesh: DeviceMesh, dims: Sequence[str]) -> None:
        super().__init__()
        self.counter = CommCounter()
        self._dim_of = {mesh.get_group(d).group_name: d for d in dims}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's own dispatch runs next with this mode still active (as CommDebugMode
            # does): the collectives inside its op handlers (loss_parallel's softmax sums,
            # implicit redistributions) reach this mode as plain-tensor ops.
            return NotImplemented
        kind = _FUNCTIONAL_KINDS.get(func)
        if kind is not None:
            group = kwargs["group_name"] if kwargs and "group_name" in kwargs else args[-1]
            dim = self._dim_of.get(group, "other")
            tensor = args[0]
            if kind == "all_gather":  # the output: group size times the input
                self.counter.add_bytes(
                    f"{dim}.{kind}", tensor.numel() * tensor.element_size() * args[1]
                )
            else:
                self.counter.add(f"{dim}.{kind}", tensor)
        return func(*args, **(kwargs or {}))

    def take_sent(self) -> dict[str, int]:
        return self.counter.take_sent()
