"""The profiled steps' time: the top ops or kernels, and the split into categories.

On CPU, ops' self time on the thread that ran the step (autograd runs backward there), and
"other host time": the step's wall time that no op took. On a GPU, kernels' time on the
device; idle is the wall time during which no kernel ran. Kernels that overlap (streams)
share the overlapping time equally, so the categories sum to the wall time exactly.
"""

from __future__ import annotations

from collections import defaultdict

from torch.autograd import DeviceType

from benchmarks.profile_step.rules import CATEGORIES, HOST, IDLE, SCOPES, categorise

TOP = 20


def is_op(event) -> bool:
    """An op (aten, c10d, a custom op), not a scope or one of autograd's wrappers."""
    name = event.name
    return (
        "::" in name
        and not event.is_user_annotation
        and not name.startswith(("autograd::", "torch::autograd::"))
    )


def enclosing(event) -> list[str]:
    """The event's name, then those of the events enclosing it, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def _step_thread(events) -> int:
    return next(e.thread for e in events if e.name == "step" and e.is_user_annotation)


def cpu_times(events) -> tuple[dict[str, float], dict[str, float]]:
    """(self seconds per op name, seconds per category) on the step's thread."""
    thread = _step_thread(events)
    by_op: dict[str, float] = defaultdict(float)
    by_category: dict[str, float] = defaultdict(float)
    for event in events:
        if event.thread != thread or event.device_type != DeviceType.CPU:
            continue
        seconds = event.self_cpu_time_total / 1e6
        op = is_op(event)
        if op:
            by_op[event.name] += seconds
        by_category[categorise(enclosing(event), op)] += seconds
    return dict(by_op), dict(by_category)


def _kernels(events) -> list:
    """The device's kernels (and copies): not the scopes' device-side spans, which torch
    2.11 lists as CUDA events too."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def launch_links(raw_events) -> tuple[dict[int, int], set[tuple[int, str]]]:
    """From the profiler's raw (kineto) events: each device kernel's correlation id -> the id
    of the op that launched it, and the (id, name) of each op called from the host side
    (linked id 0). torch 2.13's FunctionEvent carries the link as ``linked_correlation_id``;
    torch 2.11's (the GPU machines') does not, so both read it here:
    ``prof.profiler.kineto_results.events()``."""
    launched_by: dict[int, int] = {}
    host_ops: set[tuple[int, str]] = set()
    for e in raw_events:
        if e.device_type() == DeviceType.CUDA:
            launched_by[e.correlation_id()] = e.linked_correlation_id()
        elif e.device_type() == DeviceType.CPU and e.linked_correlation_id() == 0:
            host_ops.add((e.correlation_id(), e.name()))
    return launched_by, host_ops


def _launcher_names(kernel, ops_by_id: dict, launched_by: dict[int, int]) -> list[str]:
    """The kernel's name, then the op that launched it and those enclosing that op."""
    return [kernel.name, *enclosing(ops_by_id.get(launched_by.get(kernel.id)))]


def _exclusive_seconds(kernels: list) -> list[float]:
    """Each kernel's share of the device's busy time: overlapping kernels split it."""
    edges = sorted(
        [(e.time_range.start, 1, i) for i, e in enumerate(kernels)]
        + [(e.time_range.end, -1, i) for i, e in enumerate(kernels)]
    )
    share = [0.0] * len(kernels)
    running: set[int] = set()
    last = 0.0
    for t, change, i in edges:
        for j in running:
            share[j] += (t - last) / 1e6 / len(running)
        last = t
        if change > 0:
            running.add(i)
        else:
            running.discard(i)
    return share


def gpu_times(events, links) -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per kernel name, exclusive seconds per category) on the device; ``links``:
    launch_links of the same profile."""
    launched_by, host_ops = links
    kernels = _kernels(events)
    ops_by_id = {
        e.id: e for e in events if e.device_type == DeviceType.CPU and (e.id, e.name) in host_ops
    }
    by_op: dict[str, float] = defaultdict(float)
    by_category: dict[str, float] = defaultdict(float)
    for kernel, seconds in zip(kernels, _exclusive_seconds(kernels), strict=True):
        by_op[kernel.name] += kernel.time_range.elapsed_us() / 1e6
        by_category[categorise(_launcher_names(kernel, ops_by_id, launched_by), True)] += seconds
    return dict(by_op), dict(by_category)


def phases(events) -> dict[str, float]:
    """Host seconds inside each of the tool's scopes (forward, loss, backward ...)."""
    out: dict[str, float] = defaultdict(float)
    for event in events:
        if event.is_user_annotation and event.name in SCOPES:
            out[event.name] += event.cpu_time_total / 1e6
    return dict(out)


def split(by_category: dict[str, float], wall: float, on_gpu: bool) -> list[dict]:
    """Seconds and share of the wall time per category, every one listed, zero or not; the
    rest is idle (GPU) or other host time (CPU)."""
    seconds = {c: by_category.get(c, 0.0) for c in CATEGORIES}
    seconds[IDLE if on_gpu else HOST] = wall - sum(seconds.values())
    return [{"category": c, "seconds": s, "share": s / wall} for c, s in seconds.items()]


def top(by_op: dict[str, float], wall: float, n: int = TOP) -> list[dict]:
    rows = sorted(by_op.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return [{"name": name, "seconds": s, "share": s / wall} for name, s in rows]
