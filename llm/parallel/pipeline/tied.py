"""Tied embeddings across pipeline stages (Megatron's embedding group).

When the first and the last stage are on different ranks, each holds its own copy of the
tied (V, d) matrix: the embedding on the first, the head on the last. Both start equal; one
all-reduce of their gradients per step (over the two ranks holding the same dp and tp
coordinate) gives each the whole model's gradient, so identical optimizer updates keep them
equal, as one shared parameter is on one process. The clipping norm counts the pair once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llm.parallel.mesh import ParallelDims
from llm.parallel.pipeline.modules import EMBEDDING, TIED_HEAD, PipelinePart
from llm.parallel.tensor_parallel import local_tensor


class TiedEmbeddings:
    """This rank's copy of a tied embedding split over two stages, and its pair's group;
    ``param`` is None on ranks without one."""

    def __init__(self, part: PipelinePart, dims: ParallelDims) -> None:
        self.param = part.tied_half()
        self.group: dist.ProcessGroup | None = None
        self.head_copy = part.tied_copy  # this rank holds the head's copy (the last stage)
        if not part.args.tie_embeddings or part.layout.stages_of(0)[-1] == part.layout.n_stages - 1:
            return  # untied, or rank 0 holds both ends (V-shaped): one parameter
        inner = dims.dp_size * dims.tp_size
        last = (part.layout.pp_size - 1) * inner
        # Every rank creates every pair's group, in the same order (new_group's contract).
        for j in range(inner):
            group = dist.new_group([j, last + j])
            if dims.rank in (j, last + j):
                self.group = group

    def holds(self, param: torch.Tensor) -> bool:
        return self.param is not None and param is self.param

    def sum_grads(self) -> None:
        """Add the other copy's gradient to this one's (before clipping and the step)."""
        # Both copies are frozen or neither (llm.parallel.pipeline.modules freezes the pair).
        if self.param is None or not self.param.requires_grad:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        self.sum(local_tensor(self.param.grad))

    def sum(self, grad: torch.Tensor) -> None:
        """Add the other copy's ``grad`` to this one's, in place: the whole gradient, or a
        slice both ends hold alike (our ZeRO's shard of the copy's own bucket)."""
        if self.param is not None and self.param.requires_grad:
            dist.all_reduce(grad, group=self.group)

    def rename(self, optim_state: dict, whole: bool) -> dict:
        """One process keys the shared parameter's optimizer state by the embedding's name:
        the head copy saves under it (``whole``) and loads from it, so checkpoints move
        between layouts. Both copies' states are equal, as their gradients are."""
        if not self.head_copy:
            return optim_state
        src, dst = (TIED_HEAD, EMBEDDING) if whole else (EMBEDDING, TIED_HEAD)
        state = {dst if k == src else k: v for k, v in optim_state["state"].items()}
        groups = [
            {**g, "params": [dst if n == src else n for n in g["params"]]}
            for g in optim_state["param_groups"]
        ]
        return {**optim_state, "state": state, "param_groups": groups}
