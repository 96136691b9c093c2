"""The cuBLAS workspaces a training step on a GPU holds: the ``cublas_workspaces`` row.

torch gives every (cuBLAS handle, stream) pair a workspace from the caching allocator, so it
counts in ``torch.cuda.max_memory_allocated`` though no tensor of the run holds it
(aten/src/ATen/cuda/CublasHandlePool.cpp: ``parseChosenWorkspaceSize``; cuBLASLt shares it
unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``). Handles are per thread: a training step's
matmuls run on two, the forward's (the main thread) and the backward's (autograd's thread
for the device), each on the current stream, so two workspaces persist from the first step.
The size is torch's default, 32 MiB on compute capability 9.x-12.x (Hopper, Blackwell) and
``:4096:2:16:8`` (8 MiB + 128 KiB) before, or what ``CUBLAS_WORKSPACE_CONFIG`` says.

On the H200 (docs/recompute.md, "The memory estimator") the allocator held 65-66 MiB
before every row but the first, left by the earlier rows' runs in the same process: these
two workspaces and 1-2 MiB the row does not name.
"""

from __future__ import annotations

import os
import re

import torch

KIB = 1024
HANDLES_PER_TRAINING_STEP = 2  # the forward's thread, autograd's device thread
# Compute capability majors of the GPUs estimate.device names (device_profile's names).
MAJOR = {"a100": 8, "h100": 9, "h200": 9}
HOPPER = 9


def workspace_bytes(major: int, config: str | None) -> int:
    """One workspace's bytes as torch sizes it: ``config`` (CUBLAS_WORKSPACE_CONFIG,
    ``:SIZE_KIB:COUNT`` pairs) where it parses, else the default for ``major``."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * KIB * int(count) for size, count in pairs)
    if 9 <= major <= 12:
        return 4096 * KIB * 8
    return 4096 * KIB * 2 + 16 * KIB * 8


def device_major(device: str) -> int:
    """The compute capability major ``estimate.device`` stands for: a named GPU's; for cuda
    or a profile's path this machine's GPU where it has one, else Hopper's (the default
    ``estimate.device_memory_gb`` is an H100's 80 GB)."""
    if device in MAJOR:
        return MAJOR[device]
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0]
    return HOPPER


def training_workspaces(device: str) -> int:
    """The ``cublas_workspaces`` row of a training estimate for ``estimate.device``."""
    if device == "cpu":
        return 0
    size = workspace_bytes(device_major(device), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return HANDLES_PER_TRAINING_STEP * size
