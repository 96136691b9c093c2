"""Our ZeRO (Rajbhandari et al., 2019) on torch.distributed collectives.

- stage 1: the optimizer states and fp32 master weights are partitioned; gradients
  accumulate locally in a full buffer (working dtype: see buffers.py) and are
  reduce-scattered once, on the last micro-batch; each rank steps its slice, then the
  parameters are all-gathered.
- stage 2: gradients are reduce-scattered bucket by bucket during every backward, as soon
  as a bucket's gradients exist (overlapping the rest of backward); a bucket's full-size
  buffer is freed once its reduce-scatter completes, with at most
  ``parallelism.buckets_in_flight`` in flight, so only the rank's gradient shard stays.
- stage 3: parameters are partitioned too and gathered per transformer block (gather.py).

Gradients are reduced in the policy's ``reduce_dtype`` (fp32 under fp16/bf16), divided by
the data-parallel size before the reduction, and accumulated over micro-batches in the
master dtype (fp32) in the shard; buckets are reduce-scattered in a fixed order whatever
parameters went unused (reducer.py). Frozen parameters (requires_grad False) sit in buckets
of their own: no gradient, no master copy, no optimizer state; stage 3 still shards them.

Under tensor parallel (``parallelism.tp_size > 1``) the buckets hold each DTensor
parameter's local block (its local tensor is a view of the bucket, so stage 3's gathers
refill what the DTensor holds), every collective runs on the data-parallel group, and the
clipping norm counts a tp-replicated element once (docs/parallel.md).

Under pipeline parallel (one stage per rank) the buckets are the rank's PipelinePart's,
over its stage's dp group; the pipeline runs each micro-batch's backward inside
``_stage_backward`` (its ``grad_sync``), and a tied embedding copy is bucketed alone so the
two ends' shards add up (docs/parallel.md, "Data parallel over each stage").

Under fp16/bf16 the working parameters and gradients are 16-bit and the fp32 master copy
lives only in the partitioned optimizer: 2Φ + 2Φ + 12Φ/N bytes per rank at stage 1 as the
paper counts, plus the fp32 gradient shard (4Φ/N) and the buckets in flight. Layout:
layout.py; per-bucket tensors: buffers.py; checkpoints: state.py.

Under expert parallel (``parallelism.ep_size > 1``) each rank's expert slices are a second
set of buckets, laid out and stepped as the dense ones but cut over the edp group (the dp
ranks holding the same experts), as DeepSpeed-MoE shards them: their gradients divided by
the dp size and reduce-scattered over edp, their master and moments 1/edp of the slice,
gathered over edp after the step (stage 3: where their block runs, by a second gatherer).
Each set's collectives keep a fixed order on their own group (docs/parallel.md).

Offload (``parallelism.offload_optimizer``): cpu keeps the masters and moments in host
memory and steps them there; nvme keeps them in files and streams them through host memory
a bucket at a time (nvme/optimizer_swap.py). Under stage 3 ``offload_params=nvme`` keeps the
parameter shards in files too, read ahead of each block's gather (nvme/param_swap.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llm.comm.collectives import all_gather
from llm.comm.sent import CommCounter
from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.memory import optimizer_state_tensors, state_bytes
from llm.models import LocalSource, ModuleSource, WeightSource, materialize_from, model_blocks
from llm.optim import (
    OPTIMIZERS,
    GradientPass,
    ParamLayout,
    ShardLayout,
    optimizer_for_groups,
    optimizer_param_groups,
    wrap_optimizer,
)
from llm.parallel.param_norms import summed_squares
from llm.parallel.pipeline import PipelinePart, part_weights
from llm.parallel.step import StepResult, checked_gradient_pass, overflow_checked_step
from llm.parallel.strategy import StrategyBase, refuse_optimizer, register_strategy
from llm.parallel.tensor_parallel import tp_copies
from llm.parallel.zero import state
from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.gather import UnitGatherer
from llm.parallel.zero.layout import model_buckets
from llm.parallel.zero.nvme import OptimizerSwap, ParamSwap, RankFolder
from llm.parallel.zero.reducer import GradientReducer


class ZeroStrategy(StrategyBase):
    """The strategy protocol (llm/parallel/strategy.py) for one ZeRO stage; its step is
    llm.parallel.step's overflow-checked step over this rank's gradient shards."""

    name = "zero"
    stage = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = self.dims.dp_group()
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.buffers: list[BucketBuffers] = []
        self.expert_buffers: list[BucketBuffers] = []  # cut over edp (expert parallel)
        self.gatherers: list[UnitGatherer] = []  # stage 3: the dense set's, the experts'
        self.reducers: list[GradientReducer] = []  # the dense set's, the experts'
        self._sync = True
        self.piece_params: list = []  # (Piece, the tensor the optimizer steps), in order
        self.stage_group: dist.ProcessGroup | None = None
        self._sent = CommCounter()
        self.folder: RankFolder | None = None  # offload to nvme: this rank's files
        self.optimizer_swap: OptimizerSwap | None = None
        self.param_swap: ParamSwap | None = None

    # ---- set-up -----------------------------------------------------------------------
    def wrap(self, model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
        """``weights`` None: the model is materialised and its values are taken over; else
        the model is on the meta device and each bucket reads only what this rank holds.
        Under pipeline parallel ``model`` is this rank's PipelinePart (one stage): its
        buckets, reduced and gathered over the stage's dp group."""
        blocks = model_blocks(model)
        root = len(blocks) if self.stage == 3 else 0
        part = model if isinstance(model, PipelinePart) else None
        if weights is not None:
            weights = part_weights(model, weights)
        # Under tensor parallel both read each DTensor's local block as the whole parameter.
        source = ModuleSource(model) if weights is None else LocalSource(weights, model)
        self.buffers = self._build_buffers(model, source, part and part.tied_half())
        # The ranks a tp-split parameter's checkpoint pieces span (built by every rank at once).
        self.stage_group = self.dims.stage_group if self.dims.tp_size > 1 else None
        if self.expert_shards:
            self.expert_buffers = self._build_expert_buffers(model)
        if weights is not None:  # anything no bucket holds (none in our models) comes whole
            materialize_from(model, weights, self.device)
        every = self.buffers + self.expert_buffers
        self._buffers_of = {slot.param: buf for buf in every for slot in buf.bucket.slots}
        self._slot_of = {slot.param: slot for buf in every for slot in buf.bucket.slots}
        # Gradients reduced by the dp size (as every gradient is averaged) over each set's group.
        self.reducers = [self._reducer(self.buffers, root, self._grad_group())]
        if self.expert_buffers:
            self.reducers.append(
                self._reducer(self.expert_buffers, root, self._expert_grad_group())
            )
        self._reducer_of = {
            slot.param: reducer
            for reducer in self.reducers
            for buf in reducer.order
            for slot in buf.bucket.slots
        }
        for param in self._reducer_of:
            param.register_post_accumulate_grad_hook(self._on_grad)
        if self.stage == 3:
            units = self._units(self.buffers, root)
            if self.param_swap is not None:
                self.param_swap.set_units(units)
            self.gatherers = [
                UnitGatherer(
                    units, blocks, self.group, self.cfg.prefetch, self._count, self.param_swap
                )
            ]
            if self.expert_buffers:
                edp = self.expert_shards.edp_group
                expert_units = self._units(self.expert_buffers, root)
                self.gatherers.append(
                    UnitGatherer(expert_units, blocks, edp, self.cfg.prefetch, self._count)
                )
            for gatherer in self.gatherers:  # a pipeline runs the part's stage, not the part
                gatherer.install(model if part is None else part.stages()[0])
        self.model = model
        self._attach_pipeline(model, grad_sync=self._stage_backward)
        return model

    def _reducer(self, buffers: list[BucketBuffers], root: int, group) -> GradientReducer:
        """A set's trainable buckets, launched in the order gradients arrive: blocks from
        last to first, then the root (stage 3); stages 1-2 bucket in model order, so last
        bucket first."""
        trainable = [buf for buf in buffers if buf.bucket.trainable]
        order = sorted(trainable, key=lambda b: (b.bucket.unit == root, -b.bucket.index))
        limit = self.cfg.buckets_in_flight
        return GradientReducer(order, self.stage, group, self.world, limit, self._count)

    @staticmethod
    def _units(buffers: list[BucketBuffers], root: int) -> list[list[BucketBuffers]]:
        return [[b for b in buffers if b.bucket.unit == u] for u in range(root + 1)]

    def _build_expert_buffers(self, model: nn.Module) -> list[BucketBuffers]:
        """The expert slices as a second set of buckets, cut over their edp ranks: this
        rank's shard of its slices. The slices are materialised by expert parallel's install
        whatever the rest of the model is, so they are read from the model itself."""
        experts = self.expert_shards
        experts.sharded = True
        policy = self.precision
        buckets = model_buckets(
            model,
            self.stage,
            self.cfg.bucket_cap_mb,
            policy.working_dtype.itemsize,
            experts.edp,
            align=self.quant_block,
            only=frozenset(experts.params.values()),
        )
        source = ModuleSource(model)
        return [
            BucketBuffers(
                bucket,
                experts.edp_rank,
                self.stage,
                policy.working_dtype,
                policy.master_dtype,
                self.device,
                self.device,
                policy.reduce_dtype,
                source,
            )
            for bucket in buckets
        ]

    def group_of(self, buf: BucketBuffers) -> dist.ProcessGroup | None:
        """The group ``buf`` is cut over: the edp group for an expert slice's bucket, else dp."""
        if self.expert_shards and self.expert_shards.holds(buf.bucket.slots[0].param):
            return self.expert_shards.edp_group
        return self.group

    def _build_buffers(
        self, model: nn.Module, source: WeightSource, tied: nn.Parameter | None
    ) -> list[BucketBuffers]:
        policy = self.precision
        buckets = model_buckets(
            model,
            self.stage,
            self.cfg.bucket_cap_mb,
            policy.working_dtype.itemsize,
            self.world,
            alone=tied,
            align=self.quant_block,
            skip=frozenset(self.expert_shards.params.values() if self.expert_shards else ()),
        )
        offload = self.cfg.offload_optimizer
        master_device = torch.device("cpu") if offload != "none" else self.device
        nvme = "nvme" in (offload, self.cfg.offload_params)
        if nvme:
            self._open_swaps(buckets)
        out = []
        for bucket in buckets:  # one at a time: a master goes to its file as soon as it exists
            buf = BucketBuffers(
                bucket,
                self.rank,
                self.stage,
                policy.working_dtype,
                policy.master_dtype,
                master_device,
                self.device,
                policy.reduce_dtype,
                source,
                own_master=nvme,
                shard_device=torch.device("cpu") if self.cfg.offload_params == "cpu" else None,
            )
            if self.optimizer_swap is not None and bucket.trainable:
                self.optimizer_swap.take(buf)
            if self.param_swap is not None:
                self.param_swap.take(buf)
            out.append(buf)
        return out

    def _open_swaps(self, buckets: list) -> None:
        """This rank's folder under parallelism.nvme_path, and the files of what goes there."""
        self.folder = RankFolder(self.cfg.nvme_path)
        if self.cfg.offload_optimizer == "nvme":
            trainable = [b for b in buckets if b.trainable]
            master = self.precision.master_dtype
            self.optimizer_swap = OptimizerSwap(
                self.folder.path, trainable, self.rank, master, self.device
            )
        if self.cfg.offload_params == "nvme":
            working = self.precision.working_dtype
            self.param_swap = ParamSwap(self.folder.path, buckets, working, self.device)

    def _grad_group(self) -> dist.ProcessGroup | None:
        """Stage 3 issues parameter all-gathers during backward too. Collectives on one group
        must be issued in the same order on every rank, and a rank whose bucket waits for an
        unused parameter launches its reduce-scatter later than the others: the gradient
        collectives get a group of their own (the same ranks), so each group's order is fixed."""
        if self.stage < 3 or not dist.is_initialized():
            return self.group
        return self.dims.new_dp_group()

    def _expert_grad_group(self) -> dist.ProcessGroup | None:
        """The experts' gradient collectives: the edp group, and at stage 3 a second one over
        the same ranks, apart from the experts' gathers (as ``_grad_group``). Expert parallel
        runs without tensor and pipeline parallel, so dp ranks are global ranks."""
        experts = self.expert_shards
        if self.stage < 3:
            return experts.edp_group
        ranks = [[g + k * experts.ep for k in range(experts.edp)] for g in range(experts.ep)]
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        return group

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        refuse_optimizer(self.name, cfg.name, tp_size=self.dims.tp_size)
        block = OPTIMIZERS[cfg.name].quant_block if cfg.name in OPTIMIZERS else 0
        if block and self.quant_block % block:
            raise ConfigError(
                f"optimizer={cfg.name} needs {self.name}'s cuts on {block}-element boundaries, "
                "but the buckets were laid out without them; build the strategy with "
                "build_strategy(..., run_config=cfg) or set strategy.quant_block before wrap"
            )
        # The factory's groups (weight decay or not, per parameter) carried over to pieces.
        factory_groups = optimizer_param_groups(model, cfg)
        group_of = {p: i for i, g in enumerate(factory_groups) for p in g["params"]}
        groups = [{**g, "params": []} for g in factory_groups]
        self.piece_params = []
        for buf in self.buffers + self.expert_buffers:
            for piece, tensor in zip(buf.pieces, buf.piece_tensors, strict=True):
                groups[group_of[piece.slot.param]]["params"].append(tensor)
                self.piece_params.append((piece, tensor))
        # A rank's slice may miss a group (one bucket's slice holding only matrices, say):
        # torch optimizers step empty groups as no-ops, and every rank keeps every group so
        # that param_groups line up across ranks in checkpoints.
        self.optimizer = wrap_optimizer(
            optimizer_for_groups(groups, cfg), self.precision.update_rounding
        )
        if self.optimizer_swap is not None:  # moments made and written bucket by bucket
            self.optimizer_swap.add_state(self.optimizer)
        # Norm-based optimizers (LAMB) need whole-parameter norms of sharded pieces: the
        # parameter (slot) each of the optimizer's tensors, in param_groups order, is part of.
        slots = {id(s): i for i, s in enumerate(s for b in self._trainable for s in b.bucket.slots)}
        piece_of = {id(tensor): piece for piece, tensor in self.piece_params}
        # Expert shards: elementwise optimizers only (llm/validate/), no whole-tensor sums.
        if self.expert_shards:
            return self.optimizer
        self.optimizer.whole_param_squares = functools.partial(
            summed_squares,
            owners=[slots[id(piece_of[id(t)].slot)] for g in groups for t in g["params"]],
            n_params=len(slots),
            device=self.device,
            group=self.group,
        )
        if hasattr(self.optimizer, "shard_layout"):  # Adafactor, Muon: whole-matrix sums
            kind = {p: g.get("kind", "matrix") for g in factory_groups for p in g["params"]}
            self.optimizer.shard_layout = self._shard_layout(kind, slots, piece_of)
        return self.optimizer

    def _shard_layout(self, kind: dict, slots: dict, piece_of: dict) -> ShardLayout:
        """Every trainable parameter (slot order) with the flat range each rank's slice
        holds of it."""
        ranges = {id(s): [(0, 0)] * self.world for b in self._trainable for s in b.bucket.slots}
        for buf in self._trainable:
            for r in range(self.world):
                for piece in buf.bucket.pieces(r):
                    ranges[id(piece.slot)][r] = piece.param_range
        params = [
            ParamLayout(tuple(s.shape), kind[s.param], tuple(ranges[id(s)]))
            for b in self._trainable
            for s in b.bucket.slots
        ]
        index = {tid: slots[id(piece.slot)] for tid, piece in piece_of.items()}
        return ShardLayout(params, index, self.rank, self.group, self.device, self._count)

    # ---- backward ---------------------------------------------------------------------
    def micro_batch(self, sync: bool):
        return self._reducing(sync, release=True)

    def _stage_backward(self, last: bool):
        """One micro-batch's backward of this rank's pipeline stage (the schedule's
        ``grad_sync``): reduced as ``micro_batch`` reduces, but stage 3 keeps the root
        gathered until the step's ``last`` backward, since micro-batches whose forward
        already ran (1F1B, GPipe) still need the head for their backward."""
        return self._reducing(last, release=last)

    @contextlib.contextmanager
    def _reducing(self, sync: bool, release: bool):
        # Stage 1 keeps full gradients, so it can wait for the last micro-batch; stages 2
        # and 3 keep only a slice and must reduce every micro-batch.
        self._sync = sync or self.stage >= 2
        try:
            with self.expert_micro_batch(sync):
                yield
        except BaseException:
            for reducer in self.reducers:  # the run is failing: no further collectives
                reducer.reset()
            raise
        else:
            if self._sync:
                for reducer in self.reducers:
                    reducer.finish()
        finally:
            if release:
                for gatherer in self.gatherers:
                    gatherer.free_all()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def _on_grad(self, param: torch.Tensor) -> None:
        buf, slot = self._buffers_of[param], self._slot_of[param]
        grad = param.grad
        if isinstance(grad, DTensor):
            # Tensor parallel: the local block in the parameter's own placements (under
            # sequence parallel a norm gain's gradient is Partial: one all-reduce on tp).
            if grad.placements != param.placements:
                grad = grad.redistribute(param.device_mesh, param.placements)
            grad = grad.to_local()
            if self.stage == 1:  # accumulated into the bucket on every micro-batch
                buf.add_grad(slot, grad)
        if self._sync:
            self._reducer_of[param].on_grad(buf, slot, grad)

    # ---- step -------------------------------------------------------------------------
    @property
    def _trainable(self) -> list[BucketBuffers]:
        return [buf for buf in self.buffers + self.expert_buffers if buf.bucket.trainable]

    def _norm_inputs(self) -> tuple[list[torch.Tensor], int | list[int], dist.ProcessGroup]:
        """The gradient shards, how many ranks hold each element, and the group to sum over.
        Without tensor parallel each element lives on exactly one dp rank; with it the
        pieces of a tp-replicated parameter (norms, row-parallel biases) repeat on every tp
        rank, so each piece is counted with its own copies, summed over the world. Under
        pipeline parallel the sum runs over every stage too, and a tied embedding's two
        copies count once."""
        if self.dims.tp_size == 1 and self.schedule is None:
            # An expert slice's element too lives on one dp rank: its ep rank's, of its edp group.
            return [buf.grad_shard for buf in self._trainable], 1, self.group
        pp = self.schedule.grad_copies if self.schedule is not None else lambda _: 1
        grads, copies = [], []
        for buf in self._trainable:
            lo = buf.bucket.shard_range(self.rank)[0]
            for piece in buf.pieces:
                grads.append(buf.grad_shard[piece.start - lo : piece.stop - lo])
                param = piece.slot.param
                copies.append(tp_copies(param, self.dims.tp_size) * pp(param))
        return grads, copies, dist.group.WORLD

    def _sum_tied_grads(self) -> None:
        """A pipeline's tied embedding copy has a bucket of its own (split alike at both
        ends): its reduced shard plus the other end's is the shared parameter's gradient."""
        tied = self.schedule.tied if self.schedule is not None else None
        if tied is not None and tied.param is not None:
            tied.sum(self._buffers_of[tied.param].grad_shard)

    def clip_and_step(self, max_norm: float) -> StepResult:
        # Norm, overflow check and clipping on the gradient shards where they were reduced
        # (the device: an offloaded optimizer gets its host copy after clipping).
        self._sum_tied_grads()
        grads, replicas, group = self._norm_inputs()
        return overflow_checked_step(
            grads,
            max_norm,
            self.scaler,
            self._optimizer_step,
            self._nonfinite_grad_names,
            self.device,
            replicas,
            group,
            optimizer=self.optimizer,
        )

    def _nonfinite_grad_names(self) -> list[str]:
        names = []
        for buf in self._trainable:
            lo = buf.bucket.shard_range(buf.rank)[0]
            for piece in buf.pieces:
                if not torch.isfinite(buf.grad_shard[piece.start - lo : piece.stop - lo]).all():
                    names.append(piece.slot.name)
        return names

    def _attach_grads(self, buffers: list[BucketBuffers] | None = None) -> None:
        """Each piece tensor's .grad: its slice of the bucket's reduced gradient shard (of
        ``buffers``, default every trainable bucket)."""
        buffers = self._trainable if buffers is None else buffers
        grads = [buf.master_grad() for buf in buffers]
        if self.cfg.offload_optimizer != "none" and self.device.type == "cuda":
            # The host reads the gradients the device copied out asynchronously.
            torch.cuda.current_stream(self.device).synchronize()
        for buf, grad in zip(buffers, grads, strict=True):
            lo = buf.bucket.shard_range(buf.rank)[0]
            for piece, tensor in zip(buf.pieces, buf.piece_tensors, strict=True):
                tensor.grad = grad[piece.start - lo : piece.stop - lo]

    def _optimizer_step(self) -> None:
        if self.param_swap is not None:
            self.param_swap.settle()
        if self.optimizer_swap is not None:
            self.optimizer_swap.step(self._step_bucket)
            return
        self._attach_grads()
        self.optimizer.step()
        for buf in self._trainable:  # frozen buckets never change: nothing to gather
            self._publish(buf)

    def _step_bucket(self, buf: BucketBuffers) -> None:
        """One bucket's step while its master and moments are in memory (offload to nvme):
        only its pieces have gradients, so the optimizer steps those alone."""
        self._attach_grads([buf])
        self.optimizer.step()
        for tensor in buf.piece_tensors:
            tensor.grad = None
        # The pool buffer is refilled once this returns: the copy out of it completes first.
        self._publish(buf, non_blocking=False)

    def _publish(self, buf: BucketBuffers, non_blocking: bool = True) -> None:
        """The stepped master as the working shard, and (stages 1-2) gathered again over
        the group the bucket is cut over."""
        group = self.group_of(buf)
        if self.param_swap is not None and group is self.group:  # expert slices stay here
            self.param_swap.store(buf, buf.master)
        elif buf.master is not buf.shard:
            buf.shard.copy_(buf.master, non_blocking=non_blocking)
        if self.stage < 3:  # stage 3 gathers lazily, block by block, in the next forward
            all_gather(buf.full, buf.shard, group=group)
            self._count("all_gather", buf.full)

    def take_gradient_pass(self, extra: GradientPass, tokens: torch.Tensor) -> None:
        """The pass's reduced gradient shards, as the pieces' .grad (llm/optim/gradient_pass.py)."""
        grads, replicas, group = self._norm_inputs()
        checked_gradient_pass(
            grads,
            self.scaler,
            lambda: (self._attach_grads(), extra.consume(tokens)),
            self.device,
            replicas,
            group,
        )

    def zero_grad(self) -> None:
        for buf in self._trainable:
            buf.grad_shard.zero_()
            if self.stage == 1:  # the full buffer autograd accumulates into
                buf.grad_full.zero_()
        for _, tensor in self.piece_params:
            tensor.grad = None

    # ---- accounting and checkpoints ---------------------------------------------------
    def _count(self, kind: str, payload: torch.Tensor) -> None:
        if self.counting:  # probe steps of a run with parallelism.count_comm
            self._sent.add(kind, payload)

    def take_sent(self) -> dict[str, int]:
        """Payload bytes of our collectives on the dp group (and the expert slices' on their
        edp group), and under tensor parallel DTensor's on the mesh by dimension (``tp.*``)."""
        return self._sent.take_sent() | self.take_mesh_sent()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Working params (stage 3: the full buffers hold only the blocks gathered now, their
        storages resized to 0 otherwise) and the shards; gradient shards, full gradient
        buckets and the reduce-scatters in flight while they exist; fp32 masters (when not
        the shard itself) and moments."""
        pending = [p for reducer in self.reducers for p in reducer.pending]
        in_flight = [t for _, payload, out, _ in pending for t in (payload, out)]
        every = self.buffers + self.expert_buffers
        grads = [t for b in every for t in (b.grad_full, b.grad_shard, b.host_grad)]
        # Offloaded to nvme: what is in memory is the pools the files stream through.
        shards = [b.shard for b in every]
        if self.param_swap is not None:
            shards = self.param_swap.resident() + [b.shard for b in self.expert_buffers]
        if self.optimizer_swap is not None:
            states = self.optimizer_swap.resident()
        else:
            states = [b.master for b in every if b.master is not b.shard]
            states += optimizer_state_tensors(self.optimizer)
        return {
            "params": [b.full for b in every] + shards,
            "grads": [t for t in grads if t is not None] + in_flight,
            "optimizer_states": states,
        }

    def memory(self) -> dict[str, int]:
        return state_bytes(self.state_tensors())

    def offload_facts(self) -> dict | None:
        """Where the nvme tier's files are, which I/O it used and the bytes it moved."""
        if self.folder is None:
            return None
        out = {"nvme_path": self.cfg.nvme_path}
        if self.optimizer_swap is not None:
            out["optimizer"] = self.optimizer_swap.facts()
        if self.param_swap is not None:
            out["params"] = self.param_swap.facts()
        return out

    def close(self) -> None:
        """The end of the run: the nvme tier's files go (a crashed run's are cleared by the
        next run's ranks: nvme/folder.py)."""
        for swap in (self.optimizer_swap, self.param_swap):
            if swap is not None:
                swap.close()
        if self.folder is not None:
            self.folder.remove()

    def _touch_swapped(self) -> None:
        """A checkpoint reads or writes the offloaded files through their mappings."""
        for swap in (self.optimizer_swap, self.param_swap):
            if swap is not None:
                swap.files.touched = True

    def state_dict(self) -> dict:
        self._touch_swapped()
        saved = state.checkpoint_state(self)
        if self.schedule is not None:  # a tied head copy's state under the embedding's name
            saved["optimizer"] = self.schedule.checkpoint_names(saved["optimizer"], whole=True)
        return saved

    def load_state_dict(self, saved: dict) -> None:
        self._touch_swapped()
        if self.schedule is not None:
            optim = self.schedule.checkpoint_names(saved["optimizer"], whole=False)
            saved = {**saved, "optimizer": optim}
        state.restore_state(self, saved)


@register_strategy("zero1")
class Zero1(ZeroStrategy):
    name, stage = "zero1", 1


@register_strategy("zero2")
class Zero2(ZeroStrategy):
    name, stage = "zero2", 2


@register_strategy("zero3")
class Zero3(ZeroStrategy):
    name, stage = "zero3", 3
