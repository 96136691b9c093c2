"""``parallelism=ddp`` with tensor or pipeline parallel: whole (tp-local) parameters on every
dp rank, gradients all-reduced (averaged) over the dp sub-mesh, by torch's FSDP2-style
``replicate``.

torch's DistributedDataParallel cannot take DTensor parameters here: on a dp sub-mesh it
swaps them for new local tensors at every forward (``_pre_dp_module_transform``), which the
optimizer, checkpoints and tied embeddings do not follow. ``replicate``
(``torch.distributed._composable.replicate_with_fsdp``, torch 2.13) is FSDP2's machinery
with a replicate-only mesh: each parameter becomes a DTensor on the dp mesh (with tp: the
(dp, tp) mesh, Replicate on dp and tensor parallel's placement on tp), nothing is gathered,
and each block's gradients are all-reduced over dp in one flat buffer as soon as the block's
backward is done (as DDP's buckets overlap backward). Under pipeline parallel each stage is a
root of its own, and torch's pipeline stages hold the all-reduce back until a schedule
step's last backward, as they do for FSDP2. So this is FSDPStrategy with ``replicate`` in
place of ``fully_shard``: the same materialisation of local blocks, mixed-precision policy,
gradient sync switch and step on local shards; each gradient element is on all dp ranks.
"""

from __future__ import annotations

import torch
from torch import nn

# torch 2.13 ships the FSDP2-based replicate in this module only (a private module name;
# `torch.distributed._composable.replicate` is the older, DDP-based one).
from torch.distributed._composable.replicate_with_fsdp import replicate

from llm.config import OptimizerConfig
from llm.models import WeightSource, model_blocks
from llm.parallel.fsdp import FSDPStrategy
from llm.parallel.pipeline import PipelinePart, part_weights
from llm.parallel.single import SingleStrategy


class ReplicateDDP(FSDPStrategy):
    name = "ddp"

    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
        self.mesh = self.dims.dp_mesh()
        policy = {"mesh": self.mesh, "mp_policy": self._mixed_precision()}
        # The roots: the model, or under pipeline parallel each of this rank's stages.
        roots = model.stages() if isinstance(model, PipelinePart) else [model]
        for root in roots:
            for block in model_blocks(root):  # one all-reduce per block, once its grads exist
                replicate(block, **policy)
            replicate(root, **policy)  # the rest: embeddings, final norm, head
        if weights is not None:
            self._materialize_shards(model, roots, part_weights(model, weights))
        if self.cfg.count_comm:  # the hook sees each all-reduced buffer
            for root in roots:
                for module in (*model_blocks(root), root):
                    module.set_all_reduce_hook(self.counter.all_reduce_hook)
        self.shards = list(model.parameters())  # at rest: the dp-replicated DTensors
        self.model = model
        self._attach_pipeline(model)
        return model

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        # Whole blocks on every rank: no cross-rank norms to give (FSDP's override).
        return SingleStrategy.build_optimizer(self, model, cfg)

    @property
    def dp_replicas(self) -> int:
        return self.dims.dp_size
