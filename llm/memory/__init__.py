"""Measuring memory: bytes of tensor storages by kind, activations autograd saves, and the
process's or allocator's peaks."""

from llm.memory.activations import ActivationMemoryCounter
from llm.memory.process import cuda_peak_bytes, peak_rss_bytes, process_rss_bytes
from llm.memory.storage import local_shard, model_state_bytes, storage_bytes

__all__ = [
    "ActivationMemoryCounter",
    "cuda_peak_bytes",
    "local_shard",
    "model_state_bytes",
    "peak_rss_bytes",
    "process_rss_bytes",
    "storage_bytes",
]
