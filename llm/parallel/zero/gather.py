"""ZeRO-3 parameter gathering: each transformer block's parameters are all-gathered just
before its forward and its backward and freed right after, with the next block's gather
started early (prefetch) so it overlaps the current block's compute.

Units are the transformer blocks plus the root (embeddings, final norm, head). The root is
used at both ends of the forward, so it stays gathered from the first forward until the
end of backward (as FSDP2 keeps its root unsharded). With prefetch a rank holds at most two
blocks gathered at once (the one computing and the next), plus the root; without, one.

With ``parallelism.offload_params=nvme`` (``shards``: nvme/param_swap.py) a unit's shards are
read from their file just before its gather and released once it completes, and the unit
after the prefetched one (in the pass's direction) is read ahead meanwhile.

A block's backward is over when the gradient with respect to its input is complete (blocks
map (B, T, d) to (B, T, d) in sequence, so that input is the previous block's output): a
hook there frees the block and gathers the previous one. The last block is gathered for
backward by a hook on its output. Frozen parameters are gathered like the others (forward
and the backward through them need them); a unit may be entirely frozen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from llm.comm.collectives import all_gather
from llm.parallel.zero.buffers import BucketBuffers
from llm.parallel.zero.nvme import ParamSwap


class UnitGatherer:
    def __init__(
        self,
        units: list[list[BucketBuffers]],
        blocks: list[nn.Module],
        group: dist.ProcessGroup,
        prefetch: bool,
        count: Callable[[str, torch.Tensor], None],
        shards: ParamSwap | None = None,
    ) -> None:
        self.units = units  # units[i] for block i; units[-1] is the root
        self.blocks = blocks
        self.group = group
        self.prefetch = prefetch
        self.count = count
        self.pending: dict[int, list] = {}
        self.root = len(units) - 1
        self.shards = shards

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._before_model)
        model.register_forward_hook(self._after_model)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self._before_block(i, a))
            block.register_forward_hook(lambda m, a, out, i=i: self._after_block(i, out))

    # ---- gather / free ----------------------------------------------------------------
    def gather(self, unit: int, wait: bool = True) -> None:
        if unit not in self.pending and not all(buf.gathered for buf in self.units[unit]):
            if self.shards is not None:
                self.shards.load(unit)
            works = []
            for buf in self.units[unit]:
                buf.refill()
                # offload_params=cpu: the host shard goes to the device for its gather.
                shard = buf.shard.to(buf.full.device, non_blocking=True)
                works.append(all_gather(buf.full, shard, self.group, async_op=True))
                self.count("all_gather", buf.full)
            self.pending[unit] = works
        if wait:
            for work in self.pending.pop(unit, []):
                work.wait()
            if self.shards is not None:
                self.shards.release(unit)

    def _read_ahead(self, block: int) -> None:
        if self.shards is not None and 0 <= block < len(self.blocks):
            self.shards.read_ahead(block)

    def free(self, unit: int) -> None:
        if unit in self.pending:  # never free storage a collective is still writing
            self.gather(unit)
        for buf in self.units[unit]:
            buf.free()

    def free_all(self) -> None:
        for unit in range(len(self.units)):
            self.free(unit)

    # ---- hooks ------------------------------------------------------------------------
    def _before_model(self, module, args) -> None:
        self.gather(self.root)
        if self.prefetch and self.blocks:
            self.gather(0, wait=False)
        self._read_ahead(1 if self.prefetch else 0)

    def _after_model(self, module, args, out) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will free it
            self.free(self.root)

    def _before_block(self, i: int, args) -> None:
        self.gather(i)
        if self.prefetch and i + 1 < len(self.blocks):
            self.gather(i + 1, wait=False)
        self._read_ahead(i + 2 if self.prefetch else i + 1)
        x = args[0] if args else None
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad, i=i: self._after_block_backward(i))

    def _after_block(self, i: int, out) -> None:
        last = i == len(self.blocks) - 1
        if last and torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            # The gradient w.r.t. the output arrives just before the block's own backward
            # (and before a recompute wrapper re-runs its forward).
            out.register_hook(lambda grad, i=i: self._before_block_backward(i))
        self.free(i)

    def _before_block_backward(self, i: int) -> None:
        self.gather(i)
        if self.prefetch and i > 0:
            self.gather(i - 1, wait=False)
        self._read_ahead(i - 2 if self.prefetch else i - 1)

    def _after_block_backward(self, i: int) -> None:
        # Free first: the previous block's gather and the prefetch before it then add to
        # one gathered block, not two.
        self.free(i)
        if i > 0:
            self._before_block_backward(i - 1)
