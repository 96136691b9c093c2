"""Measurement helpers the Trainer calls once per step: throughput, MFU, timing. Memory
is measured in llm.memory."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: exp of a diverged loss overflows


@dataclass(frozen=True)
class StepTiming:
    step_time_s: float
    data_wait_s: float

    @property
    def data_wait_share(self) -> float:
        return self.data_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0


class StepTimer:
    """Time per optimizer step and the part of it spent waiting for batches, read late.

    ``with timer.step():`` brackets the whole step (all micro-batches); inside it,
    ``with timer.data():`` brackets each ``next(batches)``. Nothing here waits for the GPU
    while steps run: on CUDA each step boundary records an event in the stream, and
    ``collect()``, called on logged steps only, waits for the last one and reads every step
    finished since the previous call. An event marks when the GPU reaches that point, so a
    step's time is the GPU's from the start of its work to the end of it, idle gaps waiting
    for the host included. On CPU the clock is read at the boundaries. Data waits are host
    time blocked in the loader (no sync there either: that would remove the CPU/GPU overlap
    being measured), an upper bound on the GPU's stall.
    """

    def __init__(
        self, device: torch.device, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.device = device
        self.clock = clock
        self._pending: list[tuple[object, object, float]] = []  # (start, end, data wait)
        self._data_wait = 0.0

    def _mark(self):
        if self.device.type != "cuda":
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def step(self) -> Iterator[None]:
        self._data_wait = 0.0
        start = self._mark()
        yield
        self._pending.append((start, self._mark(), self._data_wait))

    @contextmanager
    def data(self) -> Iterator[None]:
        start = self.clock()
        yield
        self._data_wait += self.clock() - start

    def collect(self) -> list[StepTiming]:
        """Every step finished since the last call, oldest first. On CUDA this waits for the
        GPU to finish the last of them: call it where the host syncs anyway."""
        done, self._pending = self._pending, []
        return [StepTiming(_elapsed_s(start, end), wait) for start, end, wait in done]


def _elapsed_s(start, end) -> float:
    if not isinstance(end, torch.cuda.Event):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # milliseconds
