"""The tensors one bucket owns on one rank, per ZeRO stage.

| tensor       | stage 1, 2                    | stage 3                          |
|--------------|-------------------------------|----------------------------------|
| full         | working params, persistent    | gathered per unit, then freed    |
| shard        | view of full[r*S:(r+1)*S]     | persistent, S elements           |
| grad_full    | persistent (stage 1) / per backward (stage 2) | per backward     |
| grad_shard   | view of grad_full (stage 1) / persistent S (stage 2) | persistent S |
| master       | fp32 S copy under mixed precision or offload, else a view of shard |

Initial values come from a WeightSource: the rank's slice (``master``, and ``shard`` under
stage 3) is read piece by piece, the whole working buffer only under stages 1-2.

Freeing a stage-3 ``full`` resizes its storage to zero bytes: the parameters stay views of
it (and so do tensors autograd saved), and refilling the storage makes them valid again.
"""

from __future__ import annotations

import torch

from llm.models import WeightSource, adopt, flat_range
from llm.parallel.zero.layout import Bucket, Piece


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
        weights: WeightSource,
    ) -> None:
        self.bucket = bucket
        self.stage = stage
        lo, hi = bucket.shard_range(rank)
        self.pieces: list[Piece] = bucket.pieces(rank)
        separate = master_dtype != working_dtype or master_device != device
        # fp32 values of this rank's slice, for the stage-3 shard and a separate master.
        values = self._slice_values(weights, lo, hi, device) if stage == 3 or separate else None
        self.full = torch.zeros(bucket.padded, dtype=working_dtype, device=device)
        for slot in bucket.slots:
            view = self.full[slot.offset : slot.offset + slot.numel]
            if stage < 3:  # the working parameters are whole on every rank
                view.copy_(weights.whole(slot.name, device).flatten())
            adopt(slot.param, view.view(slot.param.shape))
        self.shard = self.full[lo:hi] if stage < 3 else values.to(working_dtype)
        if stage == 1:
            # Gradients accumulate straight into the bucket (autograd adds into .grad in
            # place), so accumulation needs no communication until the last micro-batch.
            self.grad_full: torch.Tensor | None = torch.zeros_like(self.full)
            for slot in bucket.slots:
                view = self.grad_full[slot.offset : slot.offset + slot.numel]
                slot.param.grad = view.view(slot.param.shape)
            self.grad_shard = self.grad_full[lo:hi]
        else:
            self.grad_full = None
            self.grad_shard = torch.zeros_like(self.shard)
        # The master starts from the source's fp32 values, not from rounded working weights.
        self.master = values.to(master_device, master_dtype) if separate else self.shard
        if separate and master_device.type == "cpu" and device.type == "cuda":
            self.master = self.master.pin_memory()
        # The tensors the optimizer steps: leaf views of the master shard, one per piece.
        self.piece_tensors = [
            self.master[p.start - lo : p.stop - lo].requires_grad_() for p in self.pieces
        ]
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.launched = False
        if stage == 3:
            self.free()

    def _slice_values(self, weights: WeightSource, lo: int, hi: int, device) -> torch.Tensor:
        """This rank's slice [lo, hi) of the bucket in fp32, read piece by piece: under
        stage 3 nothing larger than the slice is ever filled in full precision."""
        values = torch.zeros(hi - lo, dtype=torch.float32, device=device)  # padding: zeros
        for p in self.pieces:
            values[p.start - lo : p.stop - lo] = flat_range(
                weights, p.slot.name, *p.param_range, device
            )
        return values

    # ---- stage-3 parameter storage ----------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def refill(self) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    # ---- gradients --------------------------------------------------------------------
    def take_grad(self, slot) -> None:
        """Stage 2/3: move a parameter's fresh gradient into the bucket and drop it."""
        if self.grad_full is None:
            # Zeros: padding, and parameters unused in this backward, reduce to zero.
            self.grad_full = torch.zeros_like(self.full)
        self.grad_full[slot.offset : slot.offset + slot.numel].copy_(slot.param.grad.flatten())
        slot.param.grad = None

    def take_remaining_grads(self) -> None:
        """Before reducing a bucket some of whose parameters got no gradient."""
        for slot in self.bucket.slots:
            if slot.param.grad is not None:
                self.take_grad(slot)
        if self.grad_full is None:
            self.grad_full = torch.zeros_like(self.full)

    def master_grad(self) -> torch.Tensor:
        """The shard's gradient as the optimizer needs it (fp32, on the master's device)."""
        return self.grad_shard.to(self.master.device, self.master.dtype)
