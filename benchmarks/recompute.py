"""Recompute policies side by side: activation bytes per layer (measured and the formula's),
the peak memory of a training step, step time and its overhead against ``none``.

Per attention backend, sequence length and policy, one model is built as the Trainer builds
it (policy applied on the meta device, then materialised) and three passes run:
- count: one forward under ``llm.memory.ActivationMemoryCounter(layers=...)``: bytes kept
  for backward per block (the mean over blocks) beside ``llm.estimate.layer_terms``'s
  prediction (none, selective, full, op_sac; budget and offload have no per-layer terms);
- time: forward + loss + backward + AdamW step, ``--warmup`` steps discarded, the median of
  ``--steps``, with no counting hooks or dispatch modes installed;
- peak: one more step, measured apart from the timing: the peak tracker's step peak of live
  tensor bytes on CPU (llm.memory.PeakTracker), ``torch.cuda.max_memory_allocated`` on CUDA.
``budget`` needs ``--compile``; ``offload`` a GPU. Under ``--compile`` the blocks' labels do
not reach the compiled graph, so only the total is counted, and the peak tracker would run
the step eagerly, so the CPU peak is not measured.

    python benchmarks/recompute.py                        # CPU: gpt2-small, T 512,1024, B 1
    python benchmarks/recompute.py --device cuda --model gpt2-medium --precision bf16 \\
        --seq-lens 2048,4096 --batch 1 --compile       # adds budget and offload
Writes recompute.json and recompute.png (activation bytes per layer against step-time
overhead, one point per policy) under --out; --json / --png put them elsewhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_device import bench_device

from benchmarks.timing import one_call_s
from llm.attention import check_kernel
from llm.config import RecomputeConfig
from llm.errors import ConfigError
from llm.estimate import layer_terms
from llm.estimate.activations import RECOMPUTE as FORMULA_POLICIES
from llm.memory import (
    ActivationMemoryCounter,
    PeakTracker,
    cuda_peak_bytes,
    find_layers,
    module_state_tensors,
    reset_cuda_peak,
)
from llm.models import MODEL_SHAPES, build_model, materialize, model_args
from llm.precision import resolve_precision
from llm.recompute import recompute_policy

MiB = 2**20
# Benchmark name -> the recompute config it runs.
POLICIES = {
    "none": RecomputeConfig(name="none"),
    "full": RecomputeConfig(name="full"),
    "selective": RecomputeConfig(name="selective"),
    "op_sac": RecomputeConfig(name="op_sac"),
    "op_sac_half_mm": RecomputeConfig(name="op_sac", save_every_other_mm=True),
    "budget": RecomputeConfig(name="budget"),
    "offload": RecomputeConfig(name="offload"),
}
# Korthikanti et al. (2022), tables 2 and 4 (GPT-3 22B-1T on A100s, 16-bit).
PAPER = (
    "Korthikanti et al. 2022 (A100, 16-bit, GPT 22B-1T): full recompute costs 36-39% more "
    "step time, selective 2-7%; activations per layer s·b·h·(34 + 5·a·s/h) bytes kept whole, "
    "34·s·b·h with selective, 2·s·b·h with full."
)


@dataclass
class Row:
    backend: str
    seq_len: int
    batch: int
    policy: str
    layer_bytes: float | None  # measured, mean over blocks (None: not attributable)
    formula_bytes: int | None  # llm.estimate.layer_terms (None: no formula for the policy)
    ratio: float | None  # measured / formula
    activation_bytes: int  # every block and the outside (embeddings, head, loss)
    peak_bytes: int | None  # the training step's peak (None: not measured)
    peak_phase: str | None  # CPU: the phase the tracker's peak fell in
    step_ms: float
    min_step_ms: float
    overhead_pct: float | None  # step time against none's, same backend and T


def _default_policies(device: str, compiled: bool) -> list[str]:
    names = ["none", "full", "selective", "op_sac", "op_sac_half_mm"]
    return names + (["budget"] if compiled else []) + (["offload"] if device == "cuda" else [])


def _check_policies(names: list[str], device: str, compiled: bool) -> None:
    for name in names:
        if name not in POLICIES:
            raise SystemExit(f"--policies: {name!r} is unknown; choose from {', '.join(POLICIES)}")
        if name == "budget" and not compiled:
            raise SystemExit("--policies budget needs torch.compile: add --compile")
        if name == "offload" and device != "cuda":
            raise SystemExit(
                "--policies offload needs a CUDA device: host and device are one on CPU"
            )


class Setup:
    """One model with one policy applied, its optimizer and a batch; ``step()`` trains."""

    def __init__(self, args, backend: str, policy: str, seq: int, a) -> None:
        self.device = torch.device(a.device)
        self.precision = resolve_precision(a.precision, self.device)
        self.policy = recompute_policy(POLICIES[policy])
        meta = self.policy.apply(build_model(args, backend))
        model = materialize(meta, self.device, seed=0).to(self.precision.param_dtype).train()
        self.model = model
        self.run = torch.compile(model) if a.compile else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, args.vocab_size, (a.batch, seq + 1), generator=g).to(self.device)
        self.inputs, self.targets = data[:, :-1], data[:, 1:]  # (B, T) each

    def loss(self) -> torch.Tensor:
        with self.policy.forward_context(), self.precision.autocast(self.device):
            logits = self.run(self.inputs)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), self.targets.flatten())

    def step(self, tracker: PeakTracker | None = None) -> None:
        phase = tracker.phase if tracker is not None else lambda name: None
        phase("forward")
        loss = self.loss()
        phase("backward")
        loss.backward()
        phase("optimizer_step")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def count(s: Setup) -> tuple[float | None, int]:
    """Bytes kept for backward by one forward: the mean over blocks and the total."""
    layers = find_layers(s.model)
    with ActivationMemoryCounter(layers) as counter:
        loss = s.loss()
    del loss
    per_layer = [v for k, v in counter.by_layer.items() if k.startswith("layers.")]
    mean = sum(per_layer) / len(per_layer) if any(per_layer) else None
    return mean, counter.activation_bytes


def time_steps(s: Setup, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` steps after ``warmup``: one step per timing, which
    torch.utils.benchmark synchronises (CUDA) before and after."""
    for _ in range(warmup):
        s.step()
    return [one_call_s(s.step) * 1e3 for _ in range(steps)]


def peak(s: Setup, compiled: bool) -> tuple[int | None, str | None]:
    """One step's peak: the CUDA allocator's, or the tracker's live tensor bytes on CPU."""
    if s.device.type == "cuda":
        s.sync()
        reset_cuda_peak(s.device)
        s.step()
        s.sync()
        return cuda_peak_bytes(s.device), None
    if compiled:  # the tracker's dispatch mode makes Dynamo run the step eagerly
        return None, None
    tracker = PeakTracker(s.device, "alternate")
    tracker.watch(lambda: module_state_tensors(s.model, s.opt))
    with tracker.step(tracked=True):
        s.step(tracker)
    return tracker.last_step["total"], tracker.last_step["phase"]


def formula(args, backend: str, policy: str, seq: int, a) -> int | None:
    cfg = POLICIES[policy]
    name = "op_sac_every_other_mm" if cfg.save_every_other_mm else cfg.name
    if name not in FORMULA_POLICIES:
        return None
    prec = resolve_precision(a.precision, torch.device(a.device))
    terms = layer_terms(args, a.batch, seq, prec, backend=backend, device=a.device, recompute=name)
    return sum(terms.values())


def measure(args, backend: str, policy: str, seq: int, a) -> Row:
    s = Setup(args, backend, policy, seq, a)
    layer, total = count(s)
    times = time_steps(s, a.warmup, a.steps)  # after the count: AdamW's states exist for peak
    top, phase = peak(s, a.compile)
    predicted = formula(args, backend, policy, seq, a)
    del s
    gc.collect()
    return Row(
        backend=backend,
        seq_len=seq,
        batch=a.batch,
        policy=policy,
        layer_bytes=layer,
        formula_bytes=predicted,
        ratio=layer / predicted if layer is not None and predicted else None,
        activation_bytes=total,
        peak_bytes=top,
        peak_phase=phase,
        step_ms=statistics.median(times),
        min_step_ms=min(times),
        overhead_pct=None,
    )


def sweep(args, a) -> list[Row]:
    rows = []
    dtype = resolve_precision(a.precision, torch.device(a.device)).compute_dtype
    for backend in a.backends:
        try:
            check_kernel(
                backend, device=a.device, dtype=dtype, head_dim=args.head_dim,
                gqa=args.n_kv_heads != args.n_heads, dropout=args.dropout > 0,
                document_mask=False, training=True,
            )  # fmt: skip
        except ConfigError as e:
            print(f"skipped {backend}: {e}", file=sys.stderr)
            continue
        for seq in a.seq_lens:
            group = [measure(args, backend, policy, seq, a) for policy in a.policies]
            base = next((r.step_ms for r in group if r.policy == "none"), None)
            for r in group:
                r.overhead_pct = 100 * (r.step_ms / base - 1) if base else None
                print(_line(r), file=sys.stderr)
            rows += group
    return rows


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = (
    "backend", "T", "B", "policy", "act/layer MiB", "formula MiB", "ratio", "act total MiB",
    "step peak MiB", "peak in", "step ms (median)", "step ms (min)", "overhead vs none",
)  # fmt: skip


def _cells(r: Row) -> list[str]:
    return [
        r.backend, str(r.seq_len), str(r.batch), r.policy, _mib(r.layer_bytes),
        _mib(r.formula_bytes), _num(r.ratio, ".3f"), _mib(r.activation_bytes),
        _mib(r.peak_bytes), r.peak_phase or "-", f"{r.step_ms:.0f}", f"{r.min_step_ms:.0f}",
        _num(r.overhead_pct, "+.1f") + ("%" if r.overhead_pct is not None else ""),
    ]  # fmt: skip


def _line(r: Row) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(COLUMNS, _cells(r), strict=True))


def markdown(rows: list[Row]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|\n"
    return head + "".join("| " + " | ".join(_cells(r)) + " |\n" for r in rows)


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("backend", "policy") else "right")
    for r in rows:
        table.add_row(*_cells(r))
    Console(width=200).print(table)


def paper_lines(args, a) -> list[str]:
    """The paper's per-layer bytes for this shape (its 16-bit idealised kernels) and its times."""
    prec = resolve_precision("bf16_pure", torch.device("cpu"))
    shape = args if args.family == "gpt2" else None
    lines = [PAPER]
    for seq in a.seq_lens if shape is not None else ():
        per = {
            name: sum(
                layer_terms(
                    shape, a.batch, seq, prec, backend="eager", recompute=name, paper=True
                ).values()
            )
            for name in ("none", "selective", "full")
        }
        lines.append(
            f"  the paper's count per layer (16-bit, its kernels, dropout {args.dropout}) at "
            f"T={seq}, B={a.batch}: " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in per.items())
        )
    if a.device == "cpu":
        lines.append(
            "  CPU: step times here are not comparable with the paper's GPU figures "
            "(no tensor cores, attention and element-wise ops weigh differently, shared cores)."
        )
    return lines


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Activation bytes per layer (x) against step-time overhead (y), one point per policy;
    a panel per T, a series per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r.seq_len for r in rows})
    fig, axes = plt.subplots(1, len(seqs), figsize=(max(6 * len(seqs), 9), 4.5), squeeze=False)
    for ax, seq in zip(axes[0], seqs, strict=True):
        for backend in dict.fromkeys(r.backend for r in rows):
            sel = [
                r for r in rows
                if r.seq_len == seq and r.backend == backend
                and r.layer_bytes is not None and r.overhead_pct is not None
            ]  # fmt: skip
            if not sel:
                continue
            xs, ys = [r.layer_bytes / MiB for r in sel], [r.overhead_pct for r in sel]
            ax.plot(xs, ys, "o", label=backend)
            for r, x, y in zip(sel, xs, ys, strict=True):
                ax.annotate(r.policy, (x, y), fontsize=7, textcoords="offset points", xytext=(4, 3))
        ax.axhline(0, color="grey", lw=0.5)
        ax.set(
            title=f"T={seq}", xlabel="activations per layer (MiB)", ylabel="step time vs none (%)"
        )
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", default="gpt2-small", help=f"one of {', '.join(MODEL_SHAPES)}")
    p.add_argument("--seq-lens", default="512,1024")
    p.add_argument("--batch", type=int, default=1, help="micro-batch")
    p.add_argument(
        "--backends", help="attention backends (default: eager,sdpa on CPU, sdpa on GPU)"
    )
    p.add_argument("--policies", help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--precision", help="default: fp32 on CPU, bf16 on GPU")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model (budget needs it)"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--out", default="outputs/bench_recompute")
    p.add_argument("--json", help="default: OUT/recompute.json")
    p.add_argument("--png", help="default: OUT/recompute.png")
    a = p.parse_args(argv)
    a.device = bench_device(a.device)
    gpu = a.device == "cuda"
    if a.model not in MODEL_SHAPES:
        raise SystemExit(f"--model={a.model!r} is unknown; choose one of {', '.join(MODEL_SHAPES)}")
    a.seq_lens = [int(x) for x in a.seq_lens.split(",")]
    a.backends = (a.backends or ("sdpa" if gpu else "eager,sdpa")).split(",")
    a.policies = a.policies.split(",") if a.policies else _default_policies(a.device, a.compile)
    _check_policies(a.policies, a.device, a.compile)
    a.precision = a.precision or ("bf16" if gpu else "fp32")
    if a.steps < 1 or a.warmup < 0 or a.batch < 1:
        raise SystemExit("--steps and --batch must be >= 1 and --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> list[Row]:
    a = parse(argv)
    if a.threads:  # on a loaded machine, OpenMP threads waiting on each other thrash
        torch.set_num_threads(a.threads)
    command = " ".join(
        ["python benchmarks/recompute.py", *(sys.argv[1:] if argv is None else argv)]
    )
    # Longer positions only where T needs them: the shape's parameter count stays its own.
    longest = max(max(a.seq_lens), MODEL_SHAPES[a.model].max_seq_len)
    args = model_args(a.model, dropout=a.dropout, max_seq_len=longest)
    rows = sweep(args, a)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    title = (
        f"recompute policies, {a.model}, {a.precision}, B={a.batch}, {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {a.steps} steps after {a.warmup}"
    )
    if a.markdown:
        print(markdown(rows))
    else:
        print_table(rows, title)
    print("\n".join(paper_lines(args, a)))
    out = Path(a.out)
    json_path, png_path = (
        Path(a.json or out / "recompute.json"),
        Path(a.png or out / "recompute.png"),
    )
    for path in (json_path, png_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"title": title, "command": command, "paper": PAPER}
    json_path.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, png_path, title)
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
