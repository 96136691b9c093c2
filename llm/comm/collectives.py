"""The two collectives that sharded strategies and optimizers build on, under the names this
torch has: torch 2.13 renames them (the old names warn), older releases such as 2.11 have
only the old names."""

import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
