"""The strategy side of expert parallelism: the expert parameters this rank holds."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from llm.comm.sent import CommCounter


class ExpertShards:
    """The expert parameters of an expert-parallel model: this rank's slices, plain tensors
    the optimizer steps like any other, or (``sharded``, set by the strategy: fsdp, and our
    zero1-3 as a second set of buckets) each slice sharded again over the edp ranks. They
    differ between ep ranks, so a strategy
    - leaves their gradients to llm/parallel/experts/grads.py (summed over the edp ranks
      that hold the same experts, divided by the dp size as every other gradient is
      averaged), which counts what it sends in ``sent``, or reduce-scatters them over edp
      itself where it shards them;
    - counts each of their gradient elements on edp ranks, not dp (:meth:`replicas`);
    - checkpoints them as DTensors of the whole tensor on the (edp, ep) mesh through
      llm/parallel/experts/checkpoint.py (our ZeRO: as flat pieces placed at the slice's
      :meth:`region`), so DCP reshards them to another ep or edp size or to one process."""

    def __init__(self, params: dict[str, nn.Parameter], mesh: DeviceMesh, dp_size: int) -> None:
        self.params = params
        self.mesh = mesh
        self.ep = mesh["ep"].size()
        self.edp_group = mesh["edp"].get_group()
        # Taken once: slicing the mesh builds a DeviceMesh, which reads its rank tensor.
        self.edp = mesh["edp"].size()
        self.ep_rank, self.edp_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("edp")
        self.dp_size = dp_size
        self._ids = {id(p) for p in params.values()}
        self.sent = CommCounter()
        self.sharded = False  # each slice sharded over edp by the strategy

    def rebind(self, model: nn.Module) -> None:
        """Take the expert parameters by name from ``model`` again, after a strategy
        registered new ones in their place (FSDP2's DTensors)."""
        self.params = {n: p for n, p in model.named_parameters() if n in self.params}
        self._ids = {id(p) for p in self.params.values()}

    def holds(self, param: Tensor) -> bool:
        return id(param) in self._ids

    def region(self, param: Tensor) -> tuple[list[int], list[int]]:
        """(shape, offset) of this rank's slice ``param`` in the whole expert tensor: its
        experts' rows, from the ep rank's first."""
        shape = list(param.shape)
        return shape, [self.ep_rank * shape[0]] + [0] * (len(shape) - 1)

    def whole_shape(self, param: Tensor) -> torch.Size:
        return torch.Size((param.shape[0] * self.ep, *param.shape[1:]))

    def replicas(self) -> int:
        """Ranks holding one expert gradient element once reduced: its edp group, or one
        where the slices are sharded over it."""
        return 1 if self.sharded else self.dp_size // self.ep
