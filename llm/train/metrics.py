"""Measurement helpers the Trainer calls once per step: memory, throughput, MFU, timing.

Everything here counts what exists (tensor storages, saved activations, allocator and RSS
peaks) rather than estimating it, so ZeRO and recompute claims can be checked on CPU.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch
from torch import nn

# A weak, hashable handle on a storage keyed by its StorageImpl address. While we hold it
# the address cannot be reused, so two handles are equal exactly when the storages are one.
# Unlike data_ptr() it also tells apart meta storages, which all have data_ptr 0.
from torch.multiprocessing.reductions import StorageWeakRef

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds: a DTensor's local tensor, any other tensor itself."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: the local shard).

    Views, tied weights and params packed into one flat buffer count once, and a view counts
    its whole storage: that is what stays allocated. ``None`` is skipped. Meta tensors count
    the bytes their storage will take once materialised, so a model can be sized before it
    exists.
    """
    seen: set[StorageWeakRef] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in seen:
            seen.add(ref)
            total += storage.nbytes()
    return total


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes this rank holds for params, grads and optimizer states, from tensor storages.

    Optimizer states are every tensor in ``optimizer.state`` (AdamW's exp_avg, exp_avg_sq
    and its scalar ``step`` tensors alike); non-tensor entries (plain-float steps) hold no
    device memory and are skipped.
    """
    params = list(model.parameters())
    states = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer_states": storage_bytes(states),
    }


class ActivationMemoryCounter:
    """Counts bytes of tensors autograd saves for backward while the context is open.

    Use around a forward pass: ``with ActivationMemoryCounter() as c: loss = model(x)``, then
    ``c.bytes``. Each storage counts once (a saved view and its base, or one input saved by
    two ops, are one allocation). Parameters saved by matmuls are counted too, since autograd
    keeps them alive for backward; subtract ``model_state_bytes()["params"]`` if you only
    want activations. Inside a non-reentrant checkpointed block torch installs its own hooks,
    so only what the checkpoint really keeps (the block inputs) reaches this counter.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[StorageWeakRef] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in self._seen:
            self._seen.add(ref)
            self.bytes += storage.nbytes()
        # detach: handing back the tensor itself would tie an op's output to its own
        # grad_fn in a reference cycle; the detached alias shares storage and version counter.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> ActivationMemoryCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


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


def reset_peak(device: torch.device) -> None:
    """Start a new CUDA peak window; a no-op elsewhere (the RSS peak is lifetime-wide)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# Dense (no 2:4 sparsity) peak FLOP/s from the vendor datasheets; the "with sparsity" figures
# there are twice these. Keys are matched as whole words against torch.cuda.get_device_name,
# first match wins, so specific variants come before the family name.
# tf32 means fp32 matmuls on tensor cores (precision=tf32); fp32 is the non-tensor-core rate.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): PCIe, NVL and SXM columns.
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12, "fp8": 1513e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12, "fp8": 1670.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12, "fp8": 1979e12},
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the NVL and SXM columns.
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12, "fp8": 1670.5e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12, "fp8": 1979e12},
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM and PCIe alike.
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    # NVIDIA V100 and V100S datasheets (nvidia.com/en-us/data-center/v100): tensor-core fp16
    # ("deep learning") and fp32 rates for V100S PCIe, V100 SXM2 and V100 PCIe.
    "V100S": {"fp16": 130e12, "fp32": 16.4e12},
    "V100-SXM2": {"fp16": 125e12, "fp32": 15.7e12},
    "V100": {"fp16": 112e12, "fp32": 14e12},
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4).
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12, "fp8": 242.5e12},
    # AWS's A10G has no NVIDIA datasheet; these are the NVIDIA A10 datasheet's figures
    # (nvidia.com/en-us/data-center/products/a10-gpu), the same GA102 part, so A10G MFU is
    # approximate.
    "A10G": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 specification table; tensor
    # rates with fp32 accumulate (half the fp16-accumulate rate on GeForce), as mixed-precision
    # training runs.
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    # NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090 specification table;
    # fp32 accumulate, as above.
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
}

_DTYPE_KEYS = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def lookup_peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Peak dense FLOP/s of the GPU called ``device_name`` at ``dtype``; None if not in the table.

    ``dtype`` is a torch dtype or a table key ("tf32": torch.float32 alone cannot say whether
    the precision policy turned tensor-core fp32 matmuls on, so the caller says so).
    """
    key = dtype if isinstance(dtype, str) else _DTYPE_KEYS.get(dtype)
    for name, peaks in PEAK_FLOPS.items():
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", device_name, re.IGNORECASE):
            return peaks.get(key)
    return None


def peak_flops(device: torch.device, dtype: torch.dtype | str) -> float | None:
    """Peak dense FLOP/s of ``device`` at ``dtype``; None on CPU and for GPUs not in the table."""
    if device.type != "cuda":
        return None
    return lookup_peak_flops(torch.cuda.get_device_name(device), dtype)


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over peak; None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_sec * flops_per_token / peak


@dataclass(frozen=True)
class StepTiming:
    step_time_s: float
    data_wait_s: float

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0


class StepTimer:
    """Wall time per optimizer step and the part of it spent waiting for batches.

    ``with timer.step():`` brackets the whole step (all micro-batches); inside it,
    ``with timer.data():`` brackets each ``next(batches)``. On CUDA the step boundaries
    synchronise first, because kernels run asynchronously and the clock would otherwise stop
    before the GPU does. Data waits are not synchronised: forcing a sync there would remove
    the CPU/GPU overlap being measured, so ``data_wait_s`` is host time blocked in the loader,
    an upper bound on the GPU's stall. ``last`` holds the latest finished step.
    """

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.device = device
        self.clock = clock
        self.last: StepTiming | None = None
        self._data_wait = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def step(self) -> Iterator[None]:
        self._sync()
        self._data_wait = 0.0
        start = self.clock()
        yield
        self._sync()
        self.last = StepTiming(self.clock() - start, self._data_wait)

    @contextmanager
    def data(self) -> Iterator[None]:
        start = self.clock()
        yield
        self._data_wait += self.clock() - start
