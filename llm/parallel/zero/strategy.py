"""Our ZeRO (Rajbhandari et al., 2019) on torch.distributed collectives.

- stage 1: the optimizer states and fp32 master weights are partitioned; gradients
  accumulate locally in a full buffer and are reduce-scattered once, on the last
  micro-batch; each rank steps its slice, then the parameters are all-gathered.
- stage 2: gradients are reduce-scattered bucket by bucket during every backward, as soon
  as a bucket's gradients exist (overlapping the rest of backward), and only the rank's
  gradient slice is kept.
- stage 3: parameters are partitioned too and gathered per transformer block (gather.py).

Under fp16/bf16 the working parameters and gradients are 16-bit and the fp32 master copy
lives only in the partitioned optimizer: 2Φ + 2Φ + 12Φ/N bytes per rank at stage 1, as the
paper counts. Layout: layout.py; per-bucket tensors: buffers.py; checkpoints: state.py.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from llm.config import OptimizerConfig, ParallelismConfig
from llm.memory import storage_bytes
from llm.optim import optimizer_for_groups, param_groups, wrap_optimizer
from llm.parallel.mesh import ParallelDims
from llm.parallel.step import StepResult, overflow_checked_step
from llm.parallel.strategy import register_strategy
from llm.parallel.zero import state
from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.collectives import all_gather, reduce_scatter
from llm.parallel.zero.gather import UnitGatherer
from llm.parallel.zero.layout import build_buckets
from llm.precision import LossScaler, PrecisionPolicy, disabled_loss_scaler


class ZeroStrategy:
    """The strategy protocol (llm/parallel/strategy.py) for one ZeRO stage; its step is
    llm.parallel.step's overflow-checked step over this rank's gradient shards."""

    name = "zero"
    stage = 0

    def __init__(
        self,
        cfg: ParallelismConfig,
        dims: ParallelDims,
        precision: PrecisionPolicy,
        device: torch.device,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        self.cfg = cfg
        self.dims = dims
        self.precision = precision
        self.device = device
        self.scaler = loss_scaler or disabled_loss_scaler()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.group = self.dims.dp_group()
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.buffers: list[BucketBuffers] = []
        self.gatherer: UnitGatherer | None = None
        self._sync = True
        self._pending: list = []  # (buffers, output shard, work) of in-flight reduce-scatters
        self.piece_params: list = []  # (Piece, the tensor the optimizer steps), in order
        self._sent: Counter[str] = Counter()

    # ---- set-up -----------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        policy = self.precision
        blocks = list(getattr(model, "layers", []))
        unit_of = {}
        if self.stage == 3:
            for i, block in enumerate(blocks):
                for p in block.parameters():
                    unit_of[p] = i
        root = len(blocks) if self.stage == 3 else 0
        named = [
            (n, p, unit_of.get(p, root)) for n, p in model.named_parameters() if p.requires_grad
        ]
        if self.stage == 3:
            named.sort(key=lambda item: item[2])  # blocks in order, then the root
        itemsize = torch.empty((), dtype=policy.working_dtype).element_size()
        bucket_numel = max(1, int(self.cfg.bucket_cap_mb * 2**20 / itemsize))
        master_device = torch.device("cpu") if self.cfg.offload_optimizer else self.device
        self.buffers = [
            BucketBuffers(
                bucket,
                self.rank,
                self.stage,
                policy.working_dtype,
                policy.master_dtype,
                master_device,
                self.device,
            )
            for bucket in build_buckets(named, bucket_numel, self.world)
        ]
        self._buffers_of = {slot.param: buf for buf in self.buffers for slot in buf.bucket.slots}
        self._slot_of = {slot.param: slot for buf in self.buffers for slot in buf.bucket.slots}
        for p in self._slot_of:
            p.register_post_accumulate_grad_hook(self._on_grad)
        if self.stage == 3:
            units = [[b for b in self.buffers if b.bucket.unit == u] for u in range(root + 1)]
            self.gatherer = UnitGatherer(units, blocks, self.group, self.cfg.prefetch, self._count)
            self.gatherer.install(model)
        self.model = model
        return model

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        # The factory's groups (weight decay or not, per parameter) carried over to pieces.
        factory_groups = param_groups(model, cfg.weight_decay)
        group_of = {p: i for i, g in enumerate(factory_groups) for p in g["params"]}
        groups = [{**g, "params": []} for g in factory_groups]
        self.piece_params = []
        for buf in self.buffers:
            for piece, tensor in zip(buf.pieces, buf.piece_tensors, strict=True):
                groups[group_of[piece.slot.param]]["params"].append(tensor)
                self.piece_params.append((piece, tensor))
        # A rank's slice may miss a group (one bucket's slice holding only matrices, say):
        # torch optimizers step empty groups as no-ops, and every rank keeps every group so
        # that param_groups line up across ranks in checkpoints.
        self.optimizer = wrap_optimizer(
            optimizer_for_groups(groups, cfg), self.precision.update_rounding
        )
        # Norm-based optimizers (LAMB) need whole-parameter norms of sharded pieces.
        self.optimizer.whole_param_norms = self.whole_param_norms
        return self.optimizer

    # ---- backward ---------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, sync: bool):
        # Stage 1 keeps full gradients, so it can wait for the last micro-batch; stages 2
        # and 3 keep only a slice and must reduce every micro-batch.
        self._sync = sync or self.stage >= 2
        try:
            yield
        finally:
            self._finish_backward()

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        buf = self._buffers_of[param]
        if self.stage >= 2:
            buf.take_grad(self._slot_of[param])
        buf.ready += 1
        if buf.ready == len(buf.bucket.slots):
            self._reduce_scatter(buf)

    def _reduce_scatter(self, buf: BucketBuffers) -> None:
        out = torch.empty_like(buf.grad_shard)
        work = reduce_scatter(out, buf.grad_full, group=self.group, async_op=True)
        self._count("reduce_scatter", buf.grad_full)
        self._pending.append((buf, out, work))
        buf.launched = True
        if self.gatherer is not None:
            unit = buf.bucket.unit
            if all(b.launched for b in self.gatherer.units[unit]):
                self.gatherer.unit_done(unit)

    def _finish_backward(self) -> None:
        if self._sync and any(b.ready for b in self.buffers):
            for buf in self.buffers:  # buckets with unused parameters: reduce what exists
                if not buf.launched:
                    if self.stage >= 2:
                        buf.take_remaining_grads()
                    self._reduce_scatter(buf)
        for buf, out, work in self._pending:
            work.wait()
            out.div_(self.world)  # a sum over ranks; gradients are averaged (as DDP)
            if self.stage == 1:
                buf.grad_shard.copy_(out)
            else:
                buf.grad_shard.add_(out)
                buf.grad_full = None
        self._pending = []
        for buf in self.buffers:
            buf.ready, buf.launched = 0, False
        if self.gatherer is not None:
            self.gatherer.free_all()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    # ---- step -------------------------------------------------------------------------
    def clip_and_step(self, max_norm: float) -> StepResult:
        return overflow_checked_step(
            self._master_grads(),
            max_norm,
            self.scaler,
            self._optimizer_step,
            self._nonfinite_grad_names,
            self.device,
            grad_replicas=1,  # every gradient element lives on exactly one rank
            group=self.group,
        )

    def _master_grads(self) -> list[torch.Tensor]:
        # fp32 master gradients: norms of 16-bit scaled gradients would overflow.
        grads = [buf.master_grad() for buf in self.buffers]
        for buf, grad in zip(self.buffers, grads, strict=True):
            lo = buf.bucket.shard_range(self.rank)[0]
            for piece, tensor in zip(buf.pieces, buf.piece_tensors, strict=True):
                tensor.grad = grad[piece.start - lo : piece.stop - lo]
        return grads

    def _nonfinite_grad_names(self) -> list[str]:
        names = []
        for buf in self.buffers:
            lo = buf.bucket.shard_range(self.rank)[0]
            for piece in buf.pieces:
                if not torch.isfinite(buf.grad_shard[piece.start - lo : piece.stop - lo]).all():
                    names.append(piece.slot.name)
        return names

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        for buf in self.buffers:
            if buf.master is not buf.shard:
                buf.shard.copy_(buf.master)
            if self.stage < 3:  # stage 3 gathers lazily, block by block, in the next forward
                all_gather(buf.full, buf.shard, group=self.group)
                self._count("all_gather", buf.full)

    def zero_grad(self) -> None:
        for buf in self.buffers:
            # Stage 1's full buffer holds the shard too; stages 2-3 keep only the shard.
            (buf.grad_full if self.stage == 1 else buf.grad_shard).zero_()
        for _, tensor in self.piece_params:
            tensor.grad = None

    def whole_param_norms(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """For per-piece tensors (in optimizer order), the L2 norm over the whole parameter
        each piece belongs to, summed across ranks in one all-reduce."""
        slots = [buf_slot for buf in self.buffers for buf_slot in buf.bucket.slots]
        index = {id(s): i for i, s in enumerate(slots)}
        # On the communication device (NCCL takes no CPU tensor), also on a rank that owns
        # no piece: every rank must join the all-reduce.
        sq = torch.zeros(len(slots), dtype=torch.float32, device=self.device)
        owners = [index[id(piece.slot)] for piece, _ in self.piece_params]
        for owner, t in zip(owners, tensors, strict=True):
            sq[owner] += t.float().pow(2).sum().to(self.device)
        dist.all_reduce(sq, group=self.group)
        norms = sq.sqrt()
        return [norms[owner].to(t.device) for owner, t in zip(owners, tensors, strict=True)]

    # ---- accounting and checkpoints ---------------------------------------------------
    def _count(self, kind: str, payload: torch.Tensor) -> None:
        self._sent[kind] += payload.numel() * payload.element_size()

    def comm(self) -> dict[str, int]:
        sent, self._sent = dict(self._sent), Counter()
        return sent

    def memory(self) -> dict[str, int]:
        masters = [b.master for b in self.buffers if b.master is not b.shard]
        states = [
            v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        return {
            "params": storage_bytes(
                [b.full for b in self.buffers] + [b.shard for b in self.buffers]
            ),
            "grads": storage_bytes(
                [b.grad_shard for b in self.buffers] + [b.grad_full for b in self.buffers]
            ),
            "optimizer_states": storage_bytes(masters + states),
        }

    def state_dict(self) -> dict:
        return state.gather_state(self)

    def load_state_dict(self, saved: dict) -> None:
        state.scatter_state(self, saved)


@register_strategy("zero1")
class Zero1(ZeroStrategy):
    name, stage = "zero1", 1


@register_strategy("zero2")
class Zero2(ZeroStrategy):
    name, stage = "zero2", 2


@register_strategy("zero3")
class Zero3(ZeroStrategy):
    name, stage = "zero3", 3
