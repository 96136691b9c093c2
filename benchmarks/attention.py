"""Attention backends side by side: forward, backward and forward+backward time, TFLOP/s, what
each saves for backward and its peak memory, against T, head dim, causal or not, MHA or GQA.

FLOPs as the FlashAttention papers (and flash-attn's benchmarks) count them: forward
4·B·H·T²·D, backward 2.5 times that, forward+backward 3.5 times; halved when causal. The
shapes follow the FlashAttention-2 paper: B·T tokens fixed (--tokens) and H = width / D.
Peak memory is the CUDA allocator's peak of one forward+backward above the inputs on a GPU,
and the peak tracker's (llm.memory.PeakTracker) live tensor bytes on CPU. Every backend
the device can train with runs (llm.attention.check_kernel decides): on CPU eager and sdpa.

    python benchmarks/attention.py                       # GPU: bf16, T 512..16k
    python benchmarks/attention.py --device cpu --seq-lens 256,512,1024
Writes attention.md (the table), attention.json and attention.png under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_device import bench_device

from benchmarks.timing import median_ms
from llm.attention import attention, check_kernel
from llm.attention.measure import saved_bytes
from llm.errors import ConfigError
from llm.memory import PeakTracker

CANDIDATES = ["eager", "sdpa", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "flash_attn"]
CANDIDATES += ["flex", "triton"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    backend: str
    seq_len: int
    head_dim: int
    causal: bool
    heads: str  # "MHA" or "GQA h/h_kv"
    batch: int
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    fwd_tflops: float
    bwd_tflops: float
    fwd_bwd_tflops: float
    saved_mib: float  # saved for backward by the attention call
    peak_mib: float


def _split(name: str) -> tuple[str, str]:
    backend, _, kernel = name.partition(":")
    return backend, kernel or "auto"


def runnable(names: list[str], device: str, dtype: torch.dtype, head_dims, gqa: bool) -> list:
    """The backends that can train here, for every head dim asked; the rest say why."""
    keep = []
    for name in names:
        backend, kernel = _split(name)
        try:
            for d in head_dims:
                check_kernel(
                    backend, kernel, device=device, dtype=dtype, head_dim=d, gqa=gqa,
                    dropout=False, document_mask=False, training=True,
                )  # fmt: skip
            keep.append(name)
        except ConfigError as e:
            print(f"skipped {name}: {e}", file=sys.stderr)
    return keep


def _peak_mib(run, device: str, inputs_bytes: int) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    tracker = PeakTracker(torch.device("cpu"), "alternate")
    with tracker.step(tracked=True):
        run()
    return max(tracker.last_step["total"] - inputs_bytes, 0) / 2**20


def measure(name, shape, causal, dtype, device, min_run_time) -> Row:
    b, h, h_kv, t, d = shape
    backend, kernel = _split(name)
    g = torch.Generator(device=device).manual_seed(0)

    def make(heads):
        x = torch.randn(b, heads, t, d, generator=g, device=device, dtype=dtype)
        return x.requires_grad_()

    q, k, v = make(h), make(h_kv), make(h_kv)
    dout = torch.randn(b, h, t, d, generator=g, device=device, dtype=dtype)

    def fwd():
        return attention(q, k, v, causal=causal, backend=backend, kernel=kernel)

    out = fwd()

    def bwd():
        q.grad = k.grad = v.grad = None
        out.backward(dout, retain_graph=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dout)

    fwd_ms, bwd_ms = (
        median_ms(fwd, min_run_time=min_run_time),
        median_ms(bwd, min_run_time=min_run_time),
    )
    both_ms = median_ms(fwd_bwd, min_run_time=min_run_time)
    flops = 4 * b * h * t * t * d / (2 if causal else 1)
    inputs = sum(x.nbytes for x in (q, k, v, dout))
    saved = saved_bytes(backend, kernel, shape=shape, dtype=dtype, device=device, causal=causal)
    return Row(
        backend=name,
        seq_len=t,
        head_dim=d,
        causal=causal,
        heads="MHA" if h == h_kv else f"GQA {h}/{h_kv}",
        batch=b,
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        fwd_bwd_ms=both_ms,
        fwd_tflops=flops / fwd_ms / 1e9,
        bwd_tflops=2.5 * flops / bwd_ms / 1e9,
        fwd_bwd_tflops=3.5 * flops / both_ms / 1e9,
        saved_mib=saved / 2**20,
        peak_mib=_peak_mib(fwd_bwd, device, inputs),
    )


def sweep(args) -> list[Row]:
    device = bench_device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    head_dims = [int(x) for x in args.head_dims.split(",")]
    seq_lens = [int(x) for x in (args.seq_lens or _default_seq_lens(device)).split(",")]
    names = runnable(args.backends.split(","), device, dtype, head_dims, gqa=args.gqa > 1)
    rows = []
    for d in head_dims:
        h = args.width // d
        for groups in sorted({1, args.gqa}):
            for causal in (True, False):
                for name in names:
                    for t in seq_lens:
                        shape = (max(args.tokens // t, 1), h, h // groups, t, d)
                        try:
                            row = measure(name, shape, causal, dtype, device, args.min_run_time)
                        except (torch.OutOfMemoryError, ConfigError) as e:
                            print(f"{name} T={t}: {str(e).splitlines()[0]}", file=sys.stderr)
                            break
                        rows.append(row)
                        print(_line(row), file=sys.stderr)
                        if row.fwd_bwd_ms > args.slow_ms:  # longer T only gets slower
                            break
    return rows


def _default_seq_lens(device: str) -> str:
    return "512,1024,2048,4096,8192,16384" if device == "cuda" else "256,512,1024"


def _line(r: Row) -> str:
    return (
        f"{r.backend:>14} T={r.seq_len:<6} D={r.head_dim:<4} {'causal' if r.causal else 'full':6} "
        f"{r.heads:9} fwd+bwd {r.fwd_bwd_ms:9.2f} ms {r.fwd_bwd_tflops:7.2f} TFLOP/s"
    )


def markdown(rows: list[Row]) -> str:
    head = (
        "| backend | T | D | mask | heads | B | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s "
        "| bwd TFLOP/s | fwd+bwd TFLOP/s | saved MiB | peak MiB |\n" + "|---" * 14 + "|\n"
    )
    body = "".join(
        f"| {r.backend} | {r.seq_len} | {r.head_dim} | {'causal' if r.causal else 'none'} | "
        f"{r.heads} | {r.batch} | {r.fwd_ms:.2f} | {r.bwd_ms:.2f} | {r.fwd_bwd_ms:.2f} | "
        f"{r.fwd_tflops:.3f} | {r.bwd_tflops:.3f} | {r.fwd_bwd_tflops:.3f} | "
        f"{r.saved_mib:.1f} | {r.peak_mib:.1f} |\n"
        for r in rows
    )
    return head + body


def plot(rows: list[Row], path: Path, title: str) -> None:
    """TFLOP/s (forward+backward) and peak memory against T, one column per head dim; MHA
    rows, solid causal, dashed not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r.head_dim for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(6 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for name in dict.fromkeys(r.backend for r in rows):
            for causal, style in ((True, "-"), (False, "--")):
                sel = [
                    r for r in rows
                    if (r.backend, r.head_dim, r.causal, r.heads) == (name, d, causal, "MHA")
                ]  # fmt: skip
                if not sel:
                    continue
                label = f"{name} {'causal' if causal else 'full'}"
                ts = [r.seq_len for r in sel]
                axes[0][col].plot(
                    ts, [r.fwd_bwd_tflops for r in sel], style, marker="o", label=label
                )
                axes[1][col].plot(ts, [r.peak_mib for r in sel], style, marker="o", label=label)
        axes[0][col].set(title=f"head dim {d}", ylabel="fwd+bwd TFLOP/s", xscale="log")
        axes[1][col].set(xlabel="T", ylabel="peak MiB (fwd+bwd)", xscale="log", yscale="log")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--backends", default=",".join(CANDIDATES), help="backend[:sdpa_kernel],...")
    p.add_argument("--seq-lens", help="default: 512..16384 on cuda, 256,512,1024 on cpu")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--tokens", type=int, default=16384, help="B*T per call (B = tokens / T)")
    p.add_argument("--width", type=int, default=2048, help="H*D: H = width / head dim")
    p.add_argument("--gqa", type=int, default=4, help="query heads per K/V head in GQA rows")
    p.add_argument("--slow-ms", type=float, default=5000.0, help="stop a series past this")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds per timing")
    p.add_argument("--out", default="outputs/bench_attention")
    args = p.parse_args(argv)
    rows = sweep(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    (out / "attention.md").write_text(table)
    (out / "attention.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    device = torch.cuda.get_device_name() if bench_device(args.device) == "cuda" else "CPU"
    plot(rows, out / "attention.png", f"attention backends, {device}, torch {torch.__version__}")
    print(table)
    print(f"wrote {out}/attention.md, attention.json, attention.png", file=sys.stderr)


if __name__ == "__main__":
    main()
