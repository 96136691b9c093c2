"""The tensors one bucket owns on one rank, per ZeRO stage.

| tensor     | stage 1                    | stage 2                  | stage 3                  |
|------------|----------------------------|--------------------------|--------------------------|
| full       | working params, persistent | working params, persist. | gathered per unit, freed |
| shard      | view of full[r*S:(r+1)*S]  | view of full[r*S:...]    | persistent, S elements   |
| grad_full  | persistent, working dtype  | reduce dtype, from the bucket's first gradient until |
|            |                            | its reduce-scatter completes (reducer.py)           |
| grad_shard | S elements in the master dtype (fp32; bf16 under bf16_pure), persistent         |
| master     | an fp32 copy of the shard under mixed precision or offload, else the shard      |

Under ``offload_optimizer=nvme`` (``own_master``) the master is always a copy of its own: its
storage is moved to a file right after it is built (nvme/optimizer_swap.py). Under stage 3
``offload_params=cpu`` puts the shard in host memory (``shard_device``), and
``offload_params=nvme`` moves it to a file (nvme/param_swap.py).

Stage 1's grad_full is in the working dtype (bf16 under mixed precision) because autograd
accumulates each micro-batch's gradient into ``param.grad`` in place, and ``.grad`` must have
the parameter's dtype; an fp32 full buffer would cost 4Φ where the paper counts 2Φ. Its
reduce-scatter converts a bucket to the reduce dtype only while that bucket is in flight.

A frozen bucket (``bucket.trainable`` False) has params only: no gradients, no pieces for the
optimizer, and its shard (working dtype) is the only copy, since it never changes.

Initial values come from a WeightSource: the rank's slice (``master``, and ``shard`` under
stage 3) is read piece by piece, the whole working buffer only under stages 1-2.

Freeing a stage-3 ``full`` resizes its storage to zero bytes: the parameters stay views of
it (and so do tensors autograd saved), and refilling the storage makes them valid again.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from llm.models import WeightSource, adopt, flat_range
from llm.parallel.zero.layout import Bucket, Piece, Slot


class BucketBuffers:
    def __init__(
        self,
        bucket: Bucket,
        rank: int,
        stage: int,
        working_dtype: torch.dtype,
        master_dtype: torch.dtype,
        master_device: torch.device,
        device: torch.device,
        reduce_dtype: torch.dtype,
        weights: WeightSource,
        own_master: bool = False,
        shard_device: torch.device | None = None,
    ) -> None:
        self.bucket = bucket
        self.rank = rank  # in the group the bucket is cut over (dp, or edp for expert slices)
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        lo, hi = bucket.shard_range(rank)
        separate = bucket.trainable and (
            own_master or master_dtype != working_dtype or master_device != device
        )
        # fp32 values of this rank's slice, for the stage-3 shard and a separate master (which
        # starts from the source's values, not from rounded working weights).
        values = (
            self._slice_values(weights, bucket.pieces(rank), lo, hi, device)
            if stage == 3 or separate
            else None
        )
        self.full = torch.zeros(bucket.padded, dtype=working_dtype, device=device)
        for slot in bucket.slots:
            view = self.full[slot.offset : slot.offset + slot.numel]
            if stage < 3:  # the working parameters are whole on every rank
                view.copy_(weights.whole(slot.name, device).flatten())
            adopt(slot.param, view.view(slot.shape))
        if stage < 3:
            self.shard = self.full[lo:hi]
        else:  # offload_params=cpu: in (pinned) host memory, copied over for each gather
            where = shard_device or device
            self.shard = values.to(device=where, dtype=working_dtype)
            if where.type == "cpu" and device.type == "cuda":
                self.shard = self.shard.pin_memory()
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None  # the master's gradient when offloaded
        self.master = self.shard
        self.pieces: list[Piece] = []
        self.piece_tensors: list[torch.Tensor] = []
        if bucket.trainable:
            self._init_training(rank, master_dtype, master_device, values, separate)
        self.arrived = 0  # parameters whose gradient arrived in this backward
        if stage == 3:
            self.free()

    @staticmethod
    def _slice_values(
        weights: WeightSource, pieces: list[Piece], lo: int, hi: int, device
    ) -> torch.Tensor:
        """This rank's slice [lo, hi) of the bucket in fp32, read piece by piece: under
        stage 3 nothing larger than the slice is ever filled in full precision."""
        values = torch.zeros(hi - lo, dtype=torch.float32, device=device)  # padding: zeros
        for p in pieces:
            values[p.start - lo : p.stop - lo] = flat_range(
                weights, p.slot.name, *p.param_range, device
            )
        return values

    def _init_training(
        self,
        rank: int,
        master_dtype: torch.dtype,
        master_device,
        values: torch.Tensor | None,
        separate: bool,
    ) -> None:
        device, lo = self.full.device, self.bucket.shard_range(rank)[0]
        if self.stage == 1:
            # Gradients accumulate straight into the bucket (autograd adds into .grad in
            # place), so accumulation needs no communication until the last micro-batch.
            # A DTensor's gradient (tensor parallel) is a new DTensor, possibly placed
            # otherwise than its parameter: the strategy adds its local block in (add_grad).
            self.grad_full = torch.zeros_like(self.full)
            for slot in self.bucket.slots:
                if not isinstance(slot.param, DTensor):
                    view = self.grad_full[slot.offset : slot.offset + slot.numel]
                    slot.param.grad = view.view(slot.shape)
        self.grad_shard = torch.zeros(self.bucket.shard, dtype=master_dtype, device=device)
        # Host copies are pinned when the device is a GPU, so copies to and from it run
        # asynchronously (non_blocking) instead of through a staging buffer.
        host = {"dtype": master_dtype, "device": master_device}
        host["pin_memory"] = master_device.type == "cpu" and device.type == "cuda"
        if separate:
            self.master = torch.empty(self.shard.shape, **host).copy_(values)
        if master_device != device:
            self.host_grad = torch.empty(self.shard.shape, **host)
        self.pieces = self.bucket.pieces(rank)
        # The tensors the optimizer steps: leaf views of the master shard, one per piece.
        self.piece_tensors = [
            self.master[p.start - lo : p.stop - lo].requires_grad_() for p in self.pieces
        ]

    @property
    def complete(self) -> bool:
        """Every parameter's gradient arrived in this backward."""
        return self.arrived == len(self.bucket.slots)

    # ---- stage-3 parameter storage ----------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def refill(self) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    # ---- gradients --------------------------------------------------------------------
    def take_grad(self, slot: Slot, grad: torch.Tensor, world: int) -> None:
        """Stage 2/3: move a parameter's fresh gradient (its local block under tensor
        parallel) into the bucket, in the reduce dtype and divided by the data-parallel size
        before the reduction (fp16 headroom)."""
        if self.grad_full is None:
            # Zeros: padding, and parameters unused in this backward, reduce to zero.
            self.grad_full = torch.zeros(
                self.bucket.padded, dtype=self.reduce_dtype, device=self.full.device
            )
        view = self.grad_full[slot.offset : slot.offset + slot.numel]
        view.copy_(grad.flatten())
        view.div_(world)
        slot.param.grad = None

    def add_grad(self, slot: Slot, grad: torch.Tensor) -> None:
        """Stage 1 under tensor parallel: add a DTensor's local gradient block into the
        persistent bucket (what autograd does in place for a plain parameter)."""
        self.grad_full[slot.offset : slot.offset + slot.numel].add_(grad.flatten())
        slot.param.grad = None

    def reduce_input(self, world: int) -> torch.Tensor:
        """The full-size tensor to reduce-scatter: the bucket's gradients in the reduce
        dtype, already divided by ``world``."""
        if self.stage >= 2:
            if self.grad_full is None:  # no parameter of the bucket got a gradient
                self.grad_full = torch.zeros(
                    self.bucket.padded, dtype=self.reduce_dtype, device=self.full.device
                )
            return self.grad_full
        # Stage 1: a reduce-dtype copy while in flight (none when the dtypes agree; the
        # accumulated buffer is zeroed after the step anyway).
        payload = self.grad_full.to(self.reduce_dtype)
        return payload.div_(world)

    def reduced(self, out: torch.Tensor) -> None:
        """The reduce-scatter into ``out`` completed: add this rank's slice to the shard
        (accumulating over micro-batches) and free the full-size bucket (stages 2-3)."""
        self.grad_shard.add_(out)
        if self.stage >= 2:
            self.grad_full = None

    def master_grad(self) -> torch.Tensor:
        """The shard's gradient where the optimizer steps: the shard itself, or when the
        optimizer is offloaded a copy in (pinned) host memory, issued non-blocking; the
        caller waits for it before the host reads it."""
        if self.host_grad is None:
            return self.grad_shard
        return self.host_grad.copy_(self.grad_shard, non_blocking=True)
