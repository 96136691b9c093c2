"""How every benchmark times things: one module, so that each number in a table is timed
the same way as its neighbours.

- :func:`median_ms`: torch.utils.benchmark's ``blocked_autorange`` (it synchronises CUDA
  around each timed block, so asynchronous kernels are counted whole; its median is robust
  to outliers);
- :func:`one_call_s`: one call at a time, which torch.utils.benchmark synchronises before
  and after, for steps timed one by one;
- :func:`median_s`: CUDA events on a GPU, the wall clock on CPU, for calls that
  torch.utils.benchmark's single thread would change;
- :func:`mean_cuda_ms`: CUDA events around many calls back to back;
- :func:`mean_back_to_back_us`: the wall clock around calls back to back;
- :func:`sync`: wait for the device before reading the wall clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils import benchmark


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], *, min_run_time: float, warmup: int = 0) -> float:
    """Median milliseconds per call of ``fn`` after ``warmup`` calls, over at least
    ``min_run_time`` seconds (torch.utils.benchmark's blocked_autorange)."""
    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def one_call_s(fn: Callable[[], object]) -> float:
    """Seconds of one call; torch.utils.benchmark synchronises CUDA before and after it."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).timeit(1).median


def median_s(fn: Callable[[], object], dev: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of one call of ``fn``: CUDA events on a GPU, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mean_cuda_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean milliseconds per call over ``repeats`` calls back to back between two CUDA
    events, after 2 warm-up calls; NaN off CUDA (the warm-up calls still run there)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def mean_back_to_back_us(fn: Callable[[], object], min_run_time: float) -> float:
    """Mean microseconds per call, back to back, over at least ``min_run_time`` s after 3
    warm-up calls: GPU time where the host keeps ahead, host time where it does not.
    Not :func:`median_ms`: torch.utils.benchmark's Timer runs with one thread, which fails a
    guard of dynamo's compiled flex call, so it would time a recompile and then, past the
    recompile limit, flex's unfused reference."""
    for _ in range(3):
        fn()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_run_time:
        fn()
        calls += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6
