"""The device's real rates for the planner's time model (issue 42, part 2): matmul TFLOP/s
over the shapes the planner's layouts produce, attention forward+backward TFLOP/s per SDPA
backend, the fused AdamW step's bytes/s and element-wise kernels' bytes/s.

Matmuls: a linear of tokens T = b·s, width h (d_model) and sharded side n (h/tp, 4h/tp,
(h + 2·kv)/tp...: n/h from 1/8 to 4 covers tp 1-8 of the h and 4h matrices), timed as the
step runs it: forward (T x h)·(h x n), input gradient (T x n)·(n x h), weight gradient
(h x T)·(T x n), 6·T·h·n FLOPs the three. A row-parallel linear's three GEMMs are the same
shapes, its weight gradient transposed. Attention: B·S = 16k tokens, 2048 / D heads,
causal, FLOPs by the estimator's convention (12·S·H·D per token forward+backward, every
score counted, so a causal kernel's figure is twice the papers'). Each figure is the
median of a few calls after warm-up, timed with CUDA events; nothing else runs on them.

Besides its rows, the section writes a device profile (``device/NAME.yaml`` under the
pass's ``--out``, NAME h100 or h200 from the device's name; ``cpu-dry`` for the dry run,
never committed), the form ``estimate.device=NAME`` reads from conf/device/
(llm.estimate.device_profile). ``python -m benchmarks.gpu_pass.calibrate RECORD_DIR
[--to conf/device]`` writes it again from a committed record's rows.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu_pass import provenance
from benchmarks.gpu_pass.common import (
    OUT_ENV,
    Goal,
    Result,
    deadline,
    device,
    environment,
    write_partial_rows,
)
from benchmarks.timing import median_s
from llm.train.metrics import lookup_peak_flops

REPO = Path(__file__).resolve().parents[2]
FORMAT = 1
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
ADAMW_BYTES_PER_PARAM = 28  # fp32: reads param, grad and both moments, writes all but grad
# Bytes each element-wise kernel moves per element of its input, in units of its itemsize.
ELEMENTWISE = {"add": 3, "mul": 3, "gelu": 2, "layer_norm": 2, "rms_norm": 2}
GPU = {
    "tokens": [2048, 8192, 32768], "widths": [768, 2048, 4096, 8192, 16384],
    "ratios": [0.125, 0.25, 0.5, 1, 2, 4], "head_dims": [64, 128],
    "seq_lens": [1024, 2048, 4096, 8192, 16384], "attn_tokens": 16384, "attn_width": 2048,
    "adamw_params": 2**28, "adamw_tensors": 8, "elementwise": (32768, 8192),
    "dtype": torch.bfloat16, "warmup": 2, "reps": 5,
}  # fmt: skip
DRY = {
    "tokens": [16, 64], "widths": [32, 64], "ratios": [0.5, 1, 2], "head_dims": [16],
    "seq_lens": [32, 64], "attn_tokens": 128, "attn_width": 32, "adamw_params": 2**14,
    "adamw_tensors": 2, "elementwise": (64, 256), "dtype": torch.float32, "warmup": 1, "reps": 3,
}  # fmt: skip
COLUMNS = ["measure", "shape", "ms", "tflops", "gb_per_s", "pct_peak"]


def _sig(value: float) -> float:
    """Four significant digits: more than a median of a few calls resolves."""
    return float(f"{value:.4g}")


def _rate_row(measure, shape, s, flops=None, moved=None, peak=None, **keys) -> dict:
    tflops = None if flops is None else _sig(flops / s / 1e12)
    pct = None if tflops is None or peak is None else 100 * tflops * 1e12 / peak
    gb_s = None if moved is None else _sig(moved / s / 1e9)
    return {"measure": measure, "shape": shape, "ms": s * 1e3, "tflops": tflops,
            "gb_per_s": gb_s, "pct_peak": pct, **keys}  # fmt: skip


def matmul_row(t: int, h: int, ratio: float, spec: dict, dev, peak) -> dict:
    n = max(1, round(h * ratio))
    kw = dict(device=dev, dtype=spec["dtype"])
    x, w, dy = torch.randn(t, h, **kw), torch.randn(h, n, **kw), torch.randn(t, n, **kw)
    y, dx, dw = torch.empty(t, n, **kw), torch.empty(t, h, **kw), torch.empty(h, n, **kw)

    def triple():
        torch.mm(x, w, out=y)
        torch.mm(dy, w.t(), out=dx)
        torch.mm(x.t(), dy, out=dw)

    s = median_s(triple, dev, spec["warmup"], spec["reps"])
    shape = f"T {t}, h {h}, n {n}"
    return _rate_row("matmul", shape, s, 6 * t * h * n, peak=peak, tokens=t, width=h, ratio=ratio)


def attention_row(backend: str, d: int, seq: int, spec: dict, dev, peak) -> dict:
    heads, batch = spec["attn_width"] // d, spec["attn_tokens"] // seq
    kw = dict(device=dev, dtype=spec["dtype"])
    q, k, v = (torch.randn(batch, heads, seq, d, **kw, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, d, **kw)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    with sdpa_kernel(BACKENDS[backend]):
        s = median_s(step, dev, spec["warmup"], spec["reps"])
    flops = 12 * seq * heads * d * batch * seq
    shape = f"B {batch}, H {heads}, S {seq}, D {d}"
    return _rate_row(f"attention:{backend}", shape, s, flops, peak=peak, head_dim=d, seq=seq)


def adamw_row(spec: dict, dev) -> dict:
    chunk = spec["adamw_params"] // spec["adamw_tensors"]
    params = [
        torch.nn.Parameter(torch.randn(chunk, device=dev)) for _ in range(spec["adamw_tensors"])
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    s = median_s(opt.step, dev, spec["warmup"], spec["reps"])
    n = chunk * len(params)
    moved = ADAMW_BYTES_PER_PARAM * n
    return _rate_row("adamw_fused", f"{n:,} fp32 params", s, moved=moved, params=n)


def elementwise_rows(spec: dict, dev) -> list[dict]:
    rows_, cols = spec["elementwise"]
    kw = dict(device=dev, dtype=spec["dtype"])
    x, y, gain, bias = torch.randn(rows_, cols, **kw), torch.randn(rows_, cols, **kw), torch.ones(cols, **kw), torch.zeros(cols, **kw)  # fmt: skip
    kernels = {
        "add": lambda: x + y,
        "mul": lambda: x * y,
        "gelu": lambda: F.gelu(x),
        "layer_norm": lambda: F.layer_norm(x, (cols,), gain, bias),
        "rms_norm": lambda: F.rms_norm(x, (cols,), gain),
    }
    out = []
    for name, fn in kernels.items():
        s = median_s(fn, dev, spec["warmup"], spec["reps"])
        moved = ELEMENTWISE[name] * x.numel() * x.element_size()
        out.append(_rate_row(name, f"{rows_} x {cols} {str(spec['dtype'])[6:]}", s, moved=moved))
    return out


def profile_name(device_name: str, dry: bool) -> str:
    """h100, h200, a100... from the CUDA device's name; cpu-dry for the dry run."""
    if dry:
        return "cpu-dry"
    lowered = device_name.lower()
    for name in ("h200", "h100", "a100", "b200", "l4"):
        if name in lowered:
            return name
    return "-".join(lowered.replace("nvidia", "").split())


def _plain(value):
    """torch's version string as a plain str (yaml's safe writer takes no subclass)."""
    return None if value is None else str(value)


def profile(rows: list[dict], env: dict, spec: dict, dry: bool, record: str) -> dict:
    """The device profile llm.estimate.device_profile reads, from the section's rows."""
    by = {r["measure"]: r for r in rows if r["measure"] in ("adamw_fused", *ELEMENTWISE)}
    mm = {
        (r["tokens"], r["width"], r["ratio"]): r["tflops"] for r in rows if r["measure"] == "matmul"
    }
    attention = {}
    for backend in BACKENDS:
        got = {(r["head_dim"], r["seq"]): r["tflops"] for r in rows if r["measure"] == f"attention:{backend}"}  # fmt: skip
        grid = [[got.get((d, s)) for s in spec["seq_lens"]] for d in spec["head_dims"]]
        if all(v is not None for line in grid for v in line):
            attention[backend] = {
                "head_dim": spec["head_dims"],
                "seq": spec["seq_lens"],
                "tflops": grid,
            }
    peak = lookup_peak_flops(env["device"], "bf16")
    tflops = [[[mm.get((t, h, r)) for r in spec["ratios"]] for h in spec["widths"]] for t in spec["tokens"]]  # fmt: skip
    return {
        "format": FORMAT,
        "device": profile_name(env["device"], dry),
        "device_name": env["device"],
        "nominal_bf16_tflops": None if peak is None else peak / 1e12,
        "dtype": str(spec["dtype"]).removeprefix("torch."),
        "provenance": {**{k: _plain(env.get(k)) for k in ("torch", "cuda", "date")}, "record": record},
        "matmul": {
            "flops": "6*T*h*n per forward, input and weight gradient of a (T x h)(h x n) linear",
            "tokens": spec["tokens"], "width": spec["widths"], "shard_ratio": spec["ratios"],
            "tflops": tflops,
        },
        "attention": {
            "flops": "12*S*H*D per token forward+backward, causal, every score counted",
            "backends": attention,
        },
        "optimizer": {"kind": "adamw_fused_fp32", "bytes_per_param": ADAMW_BYTES_PER_PARAM,
                      "gb_per_s": by.get("adamw_fused", {}).get("gb_per_s")},
        "elementwise_gb_per_s": {k: by[k]["gb_per_s"] for k in ELEMENTWISE if k in by},
    }  # fmt: skip


def write_profile(prof: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prof['device']}.yaml"
    head = (
        f"# {prof['device_name']}'s measured rates for estimate.device={prof['device']}, "
        "written by benchmarks/gpu_pass/calibrate.py (docs/parallel.md, 'The time model').\n"
    )
    path.write_text(
        head + yaml.safe_dump(prof, sort_keys=False, width=100, default_flow_style=None)
    )
    return path


def _record_line(dry: bool) -> str:
    try:
        tree = provenance.current(REPO).record()
    except SystemExit as exc:  # a stale stamp: the figures still stand, their commit is unknown
        tree = {"sha": None, "dirty": None, "note": str(exc)}
    sha = (tree.get("sha") or "unknown")[:12]
    dirty = " (uncommitted changes)" if tree.get("dirty") else ""
    mode = " --dry" if dry else ""
    return f"python -m benchmarks.gpu_pass --only calibrate{mode} at commit {sha}{dirty}"


def _result(rows, notes, goals, spec, dry) -> Result:
    return Result(
        title="the device's rates for the planner's time model (estimate.device)",
        shapes=(
            f"matmul: T in {spec['tokens']}, h in {spec['widths']}, n/h in {spec['ratios']}, "
            f"forward and both gradients; attention: {spec['attn_tokens']} tokens, width "
            f"{spec['attn_width']}, causal, D in {spec['head_dims']}, S in {spec['seq_lens']}; "
            f"{str(spec['dtype'])[6:]}; median of {spec['reps']} after {spec['warmup']} warm-up"
        ),
        columns=COLUMNS,
        rows=rows,
        goals=goals,
        notes=notes,
    )


def _measure(spec: dict, dev, peak, stop_at: float) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    jobs = [("matmul", (t, h, r)) for t in spec["tokens"] for h in spec["widths"] for r in spec["ratios"]]  # fmt: skip
    jobs += [("attention", (b, d, s)) for b in BACKENDS for d in spec["head_dims"] for s in spec["seq_lens"]]  # fmt: skip
    jobs += [("adamw", ()), ("elementwise", ())]
    for kind, args in jobs:
        if time.monotonic() > stop_at:
            notes.append(f"{kind} {args}: not run, past the time limit")
            continue
        try:
            if kind == "matmul":
                rows.append(matmul_row(*args, spec, dev, peak))
            elif kind == "attention":
                rows.append(attention_row(*args, spec, dev, peak))
            elif kind == "adamw":
                rows.append(adamw_row(spec, dev))
            else:
                rows += elementwise_rows(spec, dev)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            notes.append(f"{kind} {args}: not measured ({str(exc).splitlines()[0][:160]})")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write_partial_rows(_result(rows, notes, [], spec, dev.type == "cpu"))
    return rows, notes


def run(dry: bool) -> Result:
    started = time.monotonic()
    spec, dev = (DRY if dry else GPU), device(dry)
    env = environment()
    peak = None if dry else lookup_peak_flops(env["device"], "bf16")
    rows, notes = _measure(spec, dev, peak, deadline(reserve_s=10))
    prof = profile(rows, env, spec, dry, _record_line(dry))
    out = Path(os.environ.get(OUT_ENV) or REPO / "outputs" / "gpu_pass") / "device"
    notes.append(f"profile written to {write_profile(prof, out)}")
    grid = [v for plane in prof["matmul"]["tflops"] for line in plane for v in line]
    missing = sum(v is None for v in grid)
    backends = sorted(prof["attention"]["backends"])
    complete = ("every matmul point, and attention for one backend at least", "all measured")
    value = f"{len(grid) - missing}/{len(grid)} matmul points; attention: {', '.join(backends) or 'none'}"  # fmt: skip
    met = missing == 0 and bool(backends)
    elapsed = time.monotonic() - started
    goals = [
        Goal(*complete, value, None if dry else met),
        Goal("the section's time on one H200", "<= 90 s", f"{elapsed:.0f} s", None if dry else elapsed <= 90),
    ]  # fmt: skip
    if dry:
        notes.append("dry run: fp32 on CPU at tiny sizes; SDPA's CUDA backends do not run there")
    return _result(rows, notes, goals, spec, dry)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.gpu_pass.report import load

    p = argparse.ArgumentParser(description="a device profile from a GPU pass record's rows")
    p.add_argument("record", help="a pass's --out folder holding gpu_pass.json")
    p.add_argument("--to", default="conf/device", help="the folder the profile is written to")
    a = p.parse_args(argv)
    record = load(Path(a.record))
    entry = record["sections"].get("calibrate")
    if not entry or not entry.get("result"):
        raise SystemExit(f"{a.record}: no calibrate rows in gpu_pass.json; run the section first")
    dry = bool(record.get("dry"))
    sha = (record.get("provenance") or {}).get("sha") or "unknown"
    line = f"{entry['command']} at commit {sha[:12]}, record {a.record}"
    prof = profile(entry["result"]["rows"], entry["env"], DRY if dry else GPU, dry, line)
    print(f"wrote {write_profile(prof, Path(a.to))}")


if __name__ == "__main__":
    main()
