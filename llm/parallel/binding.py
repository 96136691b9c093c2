"""Which GPU a rank trains on, from what the process can see, checked before NCCL starts.

A launcher can hand a rank every GPU of the node (torchrun, the deepspeed launcher, ours,
``srun`` with ``--gpus-per-node`` and no binding: the rank picks ``cuda:LOCAL_RANK``) or only
its own (``srun --gpus-per-task=1`` or ``--gpu-bind=single:1``: the one GPU is ``cuda:0``
in every task, whatever its local rank). Picking ``cuda:LOCAL_RANK`` in the second case ends
every local rank from 1 up in "invalid device ordinal" inside NCCL's start-up; seeing fewer
GPUs than there are ranks on the node ends some ranks there and leaves the others waiting.
Every rank of the node sees the same count, so every rank refuses together.
"""

from __future__ import annotations

import torch

from llm.errors import ConfigError
from llm.parallel.dist import RankEnv


def rank_device(env: RankEnv, device_count: int) -> torch.device:
    """``cuda:0`` when the process sees one GPU; ``cuda:LOCAL_RANK`` when it sees at least
    one per rank of its node; else ConfigError naming the variables that decided it."""
    if device_count == 1:
        return torch.device("cuda", 0)
    ranks_here = env.local_world_size
    enough = device_count >= ranks_here if ranks_here is not None else True
    if enough and env.local_rank < device_count:
        return torch.device("cuda", env.local_rank)
    raise ConfigError(binding_message(env, device_count))


def binding_message(env: RankEnv, device_count: int) -> str:
    seen = (
        ", ".join(f"{name}={value}" for name, value in env.binding_vars) or "no launcher variables"
    )
    node = "" if env.local_world_size is None else f" of {env.local_world_size} on this node"
    return (
        f"local rank {env.local_rank}{node} sees {device_count} GPU(s) ({seen}): a rank "
        "needs a GPU of its own (cuda:0) or every GPU of its node, one per rank "
        "(cuda:LOCAL_RANK); give each task one GPU (srun --gpus-per-task=1 or "
        "--gpu-bind=single:1) or every GPU of the node, or start fewer ranks per node"
    )
