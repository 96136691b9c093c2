"""Fully sharded data parallel with torch's FSDP2 (``fully_shard`` on each transformer block,
then on the root for the rest): every parameter is a DTensor of which each rank holds 1/N
(dim 0, padded to a multiple of N). A block's parameters are all-gathered just before it runs
and its gradients reduce-scattered (averaged) right after its backward, so each rank keeps
1/N of parameters, gradients and optimizer states; the inherited ``memory()`` counts exactly
that, as ``storage_bytes`` reads a DTensor's local shard.

Given a WeightSource (as llm.run does), ``wrap`` runs ``fully_shard`` on the meta-device
model, then allocates only the local shards (``to_empty``) and fills each from the rows it
covers, so no rank ever holds the unsharded model.

``parallelism.reshard_after_forward`` true frees gathered block parameters after forward and
gathers them again in backward (ZeRO-3-like: least memory, ~1.5x the bytes moved); false
keeps them until backward ends (ZeRO-2-like). ``parallelism.replicate > 1`` is HSDP:
ranks form a (replicate, shard) mesh, parameters are sharded within a row and gradients
reduce-scattered there, then all-reduced across the replicas.

With ``parallelism.count_comm`` every collective goes through the counting comm objects of
llm/parallel/comm_counter.py; without it FSDP2 uses its own.

Under fp16/bf16 the gathered parameters (and thus the compute and activations) are 16-bit
while the sharded parameters, gradients and optimizer states keep ``param_dtype``; gradients
are reduced in ``reduce_dtype``. Under bf16_pure the shards themselves are bf16 and the
optimizer's rounded update (llm/optim/rounded_update.py) steps fp32 shadows of them, written
back into each DTensor's local shard. The step routine (norm, overflow, clip) is SingleStrategy's,
run on local shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

# FSDP2's placement on dp when tensor parallel split dim 0 too; torch exports it nowhere else.
from torch.distributed.tensor.placement_types import _StridedShard

from llm.comm.sent import CommCounter
from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.memory import optimizer_state_tensors
from llm.models import WeightSource, model_blocks
from llm.models.moe import Experts
from llm.optim import OPTIMIZERS, ParamLayout, ShardLayout
from llm.parallel.comm_counter import count_fsdp_collectives
from llm.parallel.param_norms import summed_squares
from llm.parallel.pipeline import PipelinePart, part_weights
from llm.parallel.single import SingleStrategy
from llm.parallel.strategy import register_strategy


def refuse_impossible(replicate: int, dp_size: int) -> None:
    """Setups FSDP cannot run, refused by llm.validate before any rank starts (and here,
    for callers that build the strategy directly)."""
    if dp_size % replicate:
        raise ConfigError(
            f"parallelism.replicate={replicate} (HSDP) must divide the {dp_size} data-parallel "
            "ranks; change parallelism.replicate or launcher.nproc_per_node"
        )


@register_strategy("fsdp")
class FSDPStrategy(SingleStrategy):
    name = "fsdp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        refuse_impossible(self.cfg.replicate, self.dims.dp_size)
        self.counter = CommCounter()

    def _mesh(self) -> DeviceMesh:
        """The dp sub-mesh of the run's mesh; fully_shard reads a 2-D one as (replicate,
        shard): HSDP."""
        if self.dims.dp_replicate != self.cfg.replicate:  # dims built without the option
            self.dims = dataclasses.replace(self.dims, dp_replicate=self.cfg.replicate)
        return self.dims.dp_mesh()

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        p = self.precision
        # None keeps the gathered parameters in param_dtype (fp32, bf16_pure).
        gathered = p.working_dtype if p.working_dtype != p.param_dtype else None
        return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=p.reduce_dtype)

    def _offload(self) -> OffloadPolicy:
        if self.cfg.offload_params == "none":
            return OffloadPolicy()
        # Pinned host memory needs a GPU (a CPU-only torch cannot pin).
        return CPUOffloadPolicy(pin_memory=self.device.type == "cuda")

    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
            raise ConfigError(
                f"parallelism=fsdp wraps each block of model.layers (an nn.ModuleList); "
                f"{type(model).__name__} has none, use parallelism=ddp"
            )
        self.mesh = self._mesh()
        shard = {
            "mesh": self.mesh,
            "mp_policy": self._mixed_precision(),
            "offload_policy": self._offload(),
        }
        # Expert slices differ between ep ranks: each layer's are sharded over the ranks that
        # hold the same experts, before its block, which then leaves them to that module.
        # With one such rank (ep = dp) there is nothing to shard: FSDP leaves them whole and
        # plain, and micro_batch reduces their gradients (llm/parallel/experts/grads.py).
        experts = self.expert_shards
        if experts and experts.edp > 1:
            self._shard_experts(model, shard)
        elif experts:
            shard["ignored_params"] = set(experts.params.values())
        # The roots: the model, or under pipeline parallel each of this rank's stages (the
        # modules a schedule runs, each with its blocks).
        roots = model.stages() if isinstance(model, PipelinePart) else [model]
        for root in roots:
            blocks = model_blocks(root)
            for block in blocks:
                fully_shard(block, reshard_after_forward=self.cfg.reshard_after_forward, **shard)
            # The root (embeddings, final norm, output) is the last to run forward and the
            # first in backward: resharding it in between would only gather it again at once.
            fully_shard(root, reshard_after_forward=False, **shard)
            if self.cfg.prefetch:
                _prefetch_neighbours(root, blocks)
        if weights is not None:
            self._materialize_shards(model, roots, part_weights(model, weights))
        if self.cfg.count_comm:
            for root in roots:
                count_fsdp_collectives(root, self.counter, hsdp=self.cfg.replicate > 1)
        self.shards = list(model.parameters())  # at rest: the sharded DTensors
        if self.expert_shards:  # FSDP2 registered DTensors in the slices' place
            self.expert_shards.rebind(model)
        self.model = model
        self._attach_pipeline(model)
        return model

    def _shard_experts(self, model: nn.Module, shard: dict) -> None:
        """FSDP2 on each layer's experts over the edp mesh (DeepSpeed-MoE's expert data
        parallel group): gradients reduce-scattered there, summed and divided by the dp size
        as every other gradient is averaged; gathered for the layer's forward and backward."""
        experts = self.expert_shards
        for module in model.modules():
            if isinstance(module, Experts) and any(map(experts.holds, module.parameters())):
                fully_shard(
                    module,
                    **{**shard, "mesh": experts.mesh["edp"]},
                    reshard_after_forward=self.cfg.reshard_after_forward,
                )
                module.set_gradient_divide_factor(self.dims.dp_size)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        experts.sharded = True

    @torch.no_grad()
    def _materialize_shards(
        self, model: nn.Module, roots: list[nn.Module], weights: WeightSource
    ) -> None:
        """Allocate the sharded model (each rank only its shards) and fill every local
        shard from the rows it covers; nothing unsharded is ever allocated."""
        # to_empty reallocates the expert slices too (materialised already): kept aside.
        held = self.expert_shards.params if self.expert_shards else {}
        experts = {name: param.detach().clone() for name, param in held.items()}
        for root in roots:  # each FSDP root re-registers its shards after to_empty
            # With parameter offload FSDP2 keeps the shards in host memory.
            root.to_empty(device="cpu" if self.cfg.offload_params == "cpu" else self.device)
        for name, param in model.named_parameters():
            if name in experts:  # a slice whole, or (sharded over edp) its rows here
                value = experts[name]
                if isinstance(param, DTensor):
                    (start, stop), *_ = _local_region(param)
                    param.to_local().copy_(value[start:stop])
                else:
                    param.copy_(value)
                continue
            local = param.to_local()
            if local.numel():
                local.copy_(_block(weights, name, _local_region(param), local.device))

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        optimizer = super().build_optimizer(model, cfg)
        # LAMB's norms over whole parameters: each tensor is its own parameter's dim-0 rows,
        # summed over the shard dimension (HSDP's replicas hold the same rows).
        shard_group = self.mesh.get_group("dp_shard" if self.mesh.ndim == 2 else 0)
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        optimizer.whole_param_squares = functools.partial(
            summed_squares, owners=list(range(n)), n_params=n, device=self.device, group=shard_group
        )
        if hasattr(optimizer, "shard_layout"):  # Adafactor, Muon, 8-bit AdamW
            optimizer.shard_layout = self._shard_layout(optimizer, shard_group)
            _refuse_straddled_blocks(model, optimizer.shard_layout, cfg)
        return optimizer

    def _shard_layout(self, optimizer, group) -> ShardLayout:
        """Each parameter's dim-0 rows per rank of the shard dimension (torch.chunk's split,
        as ``_local_region`` checks), as flat ranges."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        params, index = [], {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                rows = p.shape[0]
                per_row, chunk = p.numel() // max(rows, 1), -(-rows // world)
                ranges = tuple(
                    (min(r * chunk, rows) * per_row, min((r + 1) * chunk, rows) * per_row)
                    for r in range(world)
                )
                index[id(p)] = len(params)
                params.append(ParamLayout(tuple(p.shape), g.get("kind", "matrix"), ranges))
        count = self.counter.add if self.cfg.count_comm else None
        return ShardLayout(params, index, rank, group, self.device, count)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The sharded parameters ``wrap`` recorded (DTensors: their local shards are
        counted), their gradients and the optimizer states. Not ``model.parameters()``:
        while a module is unsharded FSDP2 registers its gathered parameters in place of the
        shards (the root from its forward to the end of backward), so a read mid-step would
        name gathered copies as params and their unreduced gradients as grads."""
        if self.model is None:
            return {}
        return {
            "params": self.shards,
            "grads": [p.grad for p in self.shards if p.grad is not None],
            "optimizer_states": optimizer_state_tensors(self.optimizer),
        }

    @property
    def dp_replicas(self) -> int:
        # Each gradient shard exists once per replica row (HSDP), once in plain FSDP.
        return self.cfg.replicate

    @contextlib.contextmanager
    def micro_batch(self, sync: bool):
        # Without sync FSDP2 skips the reduce-scatter (and HSDP all-reduce) and accumulates
        # unsharded gradients, reduced together at the micro-batch that syncs.
        self.model.set_requires_gradient_sync(sync)  # the experts' FSDP modules too
        with self.expert_micro_batch(sync):  # slices left whole (edp = 1)
            yield

    def count_comm(self, on: bool) -> None:
        super().count_comm(on)
        self.counter.on = on  # FSDP2's collectives and the shard layout's go through it

    def take_sent(self) -> dict[str, int]:
        experts = self.expert_shards.sent.take_sent() if self.expert_shards else {}
        return self.counter.take_sent() | self.take_mesh_sent() | experts


def _refuse_straddled_blocks(model: nn.Module, layout: ShardLayout, cfg: OptimizerConfig) -> None:
    """8-bit AdamW: FSDP2 cuts dim 0 every ceil(rows / N) rows and pads nothing we could
    move. Each quantised tensor's cuts must fall on its 256-element blocks, and each rank's
    blocks must be the ones torch.chunk gives it of the absmax vector (its state is a DTensor
    sharded as the parameter, llm/optim/adamw8bit.py). Else refused, naming the tensor."""
    block = OPTIMIZERS[cfg.name].quant_block
    if not block:
        return
    for name, p in model.named_parameters():
        pl = layout.params[layout.index[id(p)]] if id(p) in layout.index else None
        if pl is None or pl.numel < cfg.min_8bit_size:
            continue
        blocks = -(-pl.numel // block)
        chunk = -(-blocks // len(pl.ranges))
        for r, (lo, hi) in enumerate(pl.ranges):
            given = (min(r * chunk, blocks), min((r + 1) * chunk, blocks))
            held = (lo // block, -(-hi // block)) if hi > lo else None
            if lo % block or held != (given if given[1] > given[0] else None):
                raise ConfigError(
                    f"optimizer={cfg.name} under parallelism=fsdp on {len(pl.ranges)} ranks: "
                    f"{name} {pl.shape} is cut inside or across its {block}-element quantisation "
                    "blocks (FSDP shards dim 0 every ceil(rows / ranks) rows); use "
                    f"parallelism=zero1-3, which aligns its cuts, or optimizer.min_8bit_size "
                    f"above {pl.numel}"
                )


def _local_region(param: DTensor) -> list[tuple[int, int]]:
    """The global [start, stop) of ``param``'s local shard along each dim. FSDP2 shards dim 0
    as torch.chunk does (ceil(rows / n) per rank, the last ones shorter or empty) on each
    mesh dimension whose placement is Shard; Replicate (HSDP's outer dimension, tensor
    parallel's norms) keeps the range. On a (dp, tp) mesh FSDP2 shards the tp-local tensor
    (``_StridedShard`` when both split dim 0), so the innermost mesh dims come first."""
    region = [(0, size) for size in param.shape]
    coordinate = param.device_mesh.get_coordinate()
    for dim in reversed(range(param.device_mesh.ndim)):
        placement = param.placements[dim]
        if isinstance(placement, Shard | _StridedShard):
            start, stop = region[placement.dim]
            chunk = -(-(stop - start) // param.device_mesh.size(dim))
            region[placement.dim] = (
                min(start + coordinate[dim] * chunk, stop),
                min(start + (coordinate[dim] + 1) * chunk, stop),
            )
    if [stop - start for start, stop in region] != list(param.to_local().shape):
        raise RuntimeError(f"FSDP2 sharded {tuple(param.shape)} unlike torch.chunk")
    return region


def _block(weights: WeightSource, name: str, region: list[tuple[int, int]], device) -> torch.Tensor:
    """``region`` of parameter ``name``: its rows read as rows, then narrowed to the columns
    tensor parallel's row split keeps."""
    (start, stop), rest = region[0], region[1:]
    block = weights.rows(name, start, stop, device)
    for dim, (first, last) in enumerate(rest, start=1):
        block = block.narrow(dim, first, last - first)
    return block


def _prefetch_neighbours(root: FSDPModule, blocks: list[FSDPModule]) -> None:
    """Gather block i+1 while block i runs forward, and block i-1 during i's backward.

    Without this FSDP2 gathers each block when it starts forward, and in backward prefetches
    one block by itself (which no public switch turns off); explicit lists issue the forward
    gathers earlier.
    """
    root.set_modules_to_forward_prefetch(blocks[:1])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
        block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0) : i])
