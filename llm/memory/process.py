"""Process-level memory figures: resident set size on CPU, the allocator's peak on CUDA."""

from __future__ import annotations

import resource
import sys

import psutil
import torch


def process_rss_bytes() -> int:
    """The resident set size of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The highest RSS this process has reached since it started (it cannot be reset)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    peak = peak if sys.platform == "darwin" else peak * 1024
    # Linux folds its RSS counters into the high-water mark lazily, so ru_maxrss can trail
    # the current RSS by a few hundred KiB; a peak below the present is never right.
    return max(peak, process_rss_bytes())


def cuda_peak_bytes(device: torch.device) -> int | None:
    """The CUDA allocator's peak allocated bytes since the last reset; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_cuda_peak(device: torch.device, empty_cache: bool = False) -> None:
    """Start the CUDA allocator's peak again from what is allocated now; a no-op off CUDA.
    ``empty_cache``: first wait for the device and hand the allocator's cached blocks back,
    so that measurements in one process start alike."""
    if device.type != "cuda":
        return
    if empty_cache:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
