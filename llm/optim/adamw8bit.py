"""bitsandbytes' AdamW8bit over sharded parameters.

Its state is quantised in blocks of 256 consecutive elements of each flattened tensor, one
absmax per block, and a tensor under ``min_8bit_size`` elements keeps 32-bit moments. A
rank's piece of a parameter quantises exactly as the whole does when two things hold:
- the piece starts at a block boundary of its parameter (our ZeRO lays parameters out on
  256-element boundaries for it, llm/parallel/zero/layout.py; FSDP's dim-0 cuts are checked
  by the strategy), so its blocks are the whole's blocks;
- the 8-bit-or-not decision is the whole tensor's: ``get_config`` reads the parameter's size
  from the ``shard_layout`` a sharding strategy sets, not the piece's.
Each element's update then depends on its own block only, as in one process.

bitsandbytes' kernels take plain tensors. Under FSDP the parameters are DTensors: each one's
state is made and stepped on its local shard, and kept as DTensors placed as the parameter:
the moments at its shape, the absmaxes as a vector of its blocks (FSDP refuses a quantised
tensor whose rank's rows are not the blocks torch.chunk gives that rank of the vector), so
that checkpoints hold every rank's blocks.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from llm.optim.shard_layout import ShardLayout

BNB_BLOCK = 256  # bitsandbytes' block for 8-bit optimizer states


@functools.cache
def sharded_adamw8bit_class() -> type:
    """The class, made on first use: importing bitsandbytes is slow and it is optional."""
    import bitsandbytes as bnb

    class AdamW8bit(bnb.optim.AdamW8bit):
        shard_layout: ShardLayout | None = None

        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if self.shard_layout is not None:
                p = self.param_groups[gindex]["params"][pindex]
                whole = self.shard_layout.parameter_of(p)[1].numel
                local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                # bitsandbytes keeps 32-bit moments where p.numel() < min_8bit_size.
                config["min_8bit_size"] = 0 if whole >= self.args.min_8bit_size else local + 1
            return config

        def init_state(self, group, p, gindex, pindex):
            if not isinstance(p, DTensor):
                return super().init_state(group, p, gindex, pindex)
            shard = p.to_local()
            super().init_state(group, shard, gindex, pindex)
            self.state[p] = {k: _placed_like(p, k, v) for k, v in self.state.pop(shard).items()}
            return None

        def update_step(self, group, p, gindex, pindex):
            if not isinstance(p, DTensor):
                return super().update_step(group, p, gindex, pindex)
            shard = p.to_local()
            shard.grad = p.grad.to_local()
            state = self.state[p]
            self.state[shard] = {k: _local(v) for k, v in state.items()}
            try:
                super().update_step(group, shard, gindex, pindex)
            finally:
                for k, v in self.state.pop(shard).items():
                    if not torch.is_tensor(v):  # the step count
                        state[k] = v
                shard.grad = None
            return None

    return AdamW8bit


MOMENTS = ("state1", "state2")  # bitsandbytes' state keys: p-shaped, 8- or 32-bit
ABSMAXES = ("absmax1", "absmax2")  # one fp32 per block


def _placed_like(p: DTensor, key: str, value):
    """A state entry made on ``p``'s local shard, as a DTensor placed as ``p``: the moments
    at ``p``'s shape, the absmaxes as (rows, blocks per row); the shared quantisation maps
    and the step as they are."""
    if key in MOMENTS:
        return DTensor.from_local(
            value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    if key in ABSMAXES:  # the strategy checked that torch.chunk splits them as p's rows
        blocks = -(-p.numel() // BNB_BLOCK)
        return DTensor.from_local(value, p.device_mesh, p.placements, shape=(blocks,), stride=(1,))
    return value


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value
