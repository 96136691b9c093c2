"""The strategy side of expert parallelism: the expert parameters this rank holds."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from llm.comm.sent import CommCounter


class ExpertShards:
    """The expert parameters of an expert-parallel model: this rank's slices, plain tensors
    the optimizer steps like any other. They differ between ep ranks, so a strategy
    - leaves their gradients to llm/parallel/experts/grads.py (summed over the edp ranks
      that hold the same experts, divided by the dp size as every other gradient is
      averaged), which counts what it sends in ``sent``;
    - counts each of their gradient elements on edp ranks, not dp (:meth:`replicas`);
    - checkpoints them as DTensors on the (edp, ep) mesh, Replicate x Shard(0), through
      llm/parallel/experts/checkpoint.py, so DCP reshards them to another ep size or to
      one process, as it does any DTensor."""

    def __init__(self, params: dict[str, nn.Parameter], mesh: DeviceMesh, dp_size: int) -> None:
        self.params = params
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.edp_group = mesh["edp"].get_group()
        # Taken once: slicing the mesh builds a DeviceMesh, which reads its rank tensor.
        self.edp = mesh["edp"].size()
        self.dp_size = dp_size
        self._ids = {id(p) for p in params.values()}
        self.sent = CommCounter()

    def holds(self, param: Tensor) -> bool:
        return id(param) in self._ids

    def replicas(self) -> int:
        """Ranks holding one expert gradient element once reduced: its edp group."""
        return self.dp_size // self.ep
