"""What the tool writes: report.md (the tables, also printed), profile.json (the same
figures), trace.json (Chrome trace) and key_averages.txt (the profiler's own table)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
from pathlib import Path

import torch

from .analyse import cpu_times, gpu_times, launch_links, phases, split, top
from .rules import LABELS


@contextlib.contextmanager
def _collections_paused():
    """The profiler's parse makes an object per event, hundreds of thousands on a GPU:
    the collections they set off scan them all again and again (an H200 profile of
    gpt2-small was still parsing after 30 s, in a collection)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def figures(windows, overrides: list[str], summary: dict) -> dict:
    """Everything the report shows, from the stopped profiler and the counter."""
    on_gpu = windows.device.type == "cuda"
    with _collections_paused():
        events = windows.prof.events()
        if on_gpu:
            raw = windows.prof.profiler.kineto_results.events()
            by_op, by_category = gpu_times(events, launch_links(raw))
        else:
            by_op, by_category = cpu_times(events)
    wall = windows.wall_s
    plan = windows.plan
    return {
        "date": datetime.date.today().isoformat(),
        "overrides": overrides,
        "device": _device_name(windows.device),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        # On a shared machine, how many others ran: a CPU profile's shares shift with it.
        "load_average_1m": os.getloadavg()[0],
        "model": summary["model"],
        "strategy": summary["strategy"],
        "precision": summary["precision"],
        "warmup_steps": plan.warmup,
        "profiled_steps": list(plan.profiled),
        "counted_steps": list(plan.counted),
        "step_kinds": windows.step_kinds,
        "profiled_wall_s": wall,
        "step_s_under_profiler": wall / plan.steps,
        "top": top(by_op, wall),
        "top_unit": "CUDA kernel time" if on_gpu else "CPU self time of ops",
        "categories": split(by_category, wall, on_gpu),
        "phases_host_s": phases(events),
        "host_reads": windows.reads.rows(plan.steps),
    }


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _top_table(f: dict) -> list[str]:
    lines = [f"| # | op or kernel | seconds | share ({f['top_unit']}) |", "|---|---|---|---|"]
    for i, row in enumerate(f["top"], 1):
        lines.append(f"| {i} | `{row['name']}` | {row['seconds']:.4f} | {_pct(row['share'])} |")
    return lines


def _category_table(f: dict) -> list[str]:
    lines = ["| category | seconds | share |", "|---|---|---|"]
    for row in f["categories"]:
        label = LABELS[row["category"]]
        lines.append(f"| {label} | {row['seconds']:.4f} | {_pct(row['share'])} |")
    return lines


def _reads_table(f: dict) -> list[str]:
    if not f["host_reads"]:
        return ["No host read on the counted steps."]
    lines = [
        "| where | via | what | tensor on | count | per step |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["host_reads"]:
        lines.append(
            f"| {r['where']} | {r['via']} | `{r['what']}` | {r['tensor_on']} | {r['count']} "
            f"| {r['per_step']:g} |"
        )
    return lines


def _kinds(f: dict, steps: list[int]) -> str:
    """The steps, with those that probed memory or were logged named."""
    marks = []
    for s in steps:
        kind = f["step_kinds"].get(s, {})
        notes = [k for k in ("probe", "logged") if kind.get(k)]
        marks.append(f"{s} ({', '.join(notes)})" if notes else str(s))
    return ", ".join(marks)


def markdown(f: dict) -> str:
    command = " ".join(["python -m benchmarks.profile_step", *f["overrides"]])
    phases_line = ", ".join(f"{k} {v:.4f} s" for k, v in f["phases_host_s"].items())
    lines = [
        f"# Where the time goes: {f['model']}, {f['strategy']}, {f['precision']}",
        "",
        f"{f['date']}, {f['device']}, load average {f['load_average_1m']:.1f}, torch "
        f"{f['torch']}. Command: `{command}`.",
        "",
        f"Warm-up steps 1..{f['warmup_steps']}; profiled steps: "
        f"{_kinds(f, f['profiled_steps'])}; host reads counted on steps "
        f"{_kinds(f, f['counted_steps'])}.",
        f"Step time under the profiler (instrumented, not a clean timing): "
        f"{f['step_s_under_profiler']:.4f} s ({f['profiled_wall_s']:.4f} s for "
        f"{len(f['profiled_steps'])} steps). Host time per scope: {phases_line}.",
        "",
        f"## Top {len(f['top'])} ops by {f['top_unit']}, share of the profiled steps' time",
        "",
        *_top_table(f),
        "",
        "## The profiled steps' time by category",
        "",
        *_category_table(f),
        "",
        "## Host reads on the step's path (Tensor.item, tolist, __bool__, __float__, __int__"
        "; cpu() of a device tensor)",
        "",
        *_reads_table(f),
        "",
    ]
    return "\n".join(lines)


def write(out: Path, windows, f: dict) -> str:
    """Write every file under ``out``; returns the markdown report."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(f)
    (out / "report.md").write_text(text)
    (out / "profile.json").write_text(json.dumps(f, indent=2) + "\n")
    windows.prof.export_chrome_trace(str(out / "trace.json"))
    sort = "self_device_time_total" if windows.device.type == "cuda" else "self_cpu_time_total"
    table = windows.prof.key_averages().table(sort_by=sort, row_limit=60)
    (out / "key_averages.txt").write_text(table + "\n")
    return text
