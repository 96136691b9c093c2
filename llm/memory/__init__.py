"""Measuring memory: bytes of tensor storages by kind, activations autograd saves, the peak
of live tensor bytes by category and phase, and the process's or allocator's peaks.

Imports no other room of llm/."""

from llm.memory.activations import (
    OUTSIDE,
    ActivationMemoryCounter,
    current_label,
    find_layers,
    kept_for_backward,
    saved_as,
)
from llm.memory.peak import CATEGORIES, MODES, PeakTracker
from llm.memory.process import (
    cuda_peak_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    reset_cuda_peak,
)
from llm.memory.storage import (
    local_shard,
    model_state_bytes,
    module_state_tensors,
    optimizer_state_tensors,
    state_bytes,
    storage_bytes,
)

__all__ = [
    "CATEGORIES",
    "MODES",
    "OUTSIDE",
    "ActivationMemoryCounter",
    "PeakTracker",
    "cuda_peak_bytes",
    "current_label",
    "find_layers",
    "kept_for_backward",
    "local_shard",
    "model_state_bytes",
    "module_state_tensors",
    "optimizer_state_tensors",
    "peak_rss_bytes",
    "process_rss_bytes",
    "reset_cuda_peak",
    "saved_as",
    "state_bytes",
    "storage_bytes",
]
