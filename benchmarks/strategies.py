"""DDP, our ZeRO-1/2/3, FSDP2, DeepSpeed ZeRO-1/2/3 and tensor, pipeline and 2-D layouts on one
model and global batch, side by side.

Every (ranks, strategy) row is one `python train.py ...` with the same model, data, seed and
global batch (micro_batch_size = global / ranks), so every strategy does the same work (the
final loss shows it). A subprocess per row rather than an in-process `launch`: its peak RSS
is its own (the benchmark's imports and earlier rows are not in it), DeepSpeed's global
state (accelerator, comms logger) and gloo's threads die with the row, a row that hangs is
killed with all its ranks (its own process group) after --timeout, a crash cannot take the
benchmark down (the row shows as failed with its one-line error and the next row runs),
and OMP_NUM_THREADS is set per rank count (cores // ranks: oversubscribed pools thrash).

Per row: the median of rank 0's `step_time_s` over the timed steps after --warmup steps; the CPU that other
processes used meanwhile (a shared machine: such rows are run again, --retakes); rank 0's
model-state bytes (params / grads / optimizer states as the strategy's memory() counts its
tensor storages after a step: the steady state) with the ZeRO paper's formula for that stage
and precision in brackets; the peak of a step (the peak tracker's high-water mark of live
tensor bytes, llm/memory/peak.py: rank 0's total, and by category with the phase it fell
in), the same tracker for every strategy, DeepSpeed included; and the payload of
the collectives per step (all-reduce buffer, reduce-scatter input, all-gather output), also
in the paper's units (elements per rank / Φ, an all-reduce counting twice: RS + AG).
Layout rows (--layouts) put tensor parallel (tp=2, with and without sequence parallel),
pipeline parallel (pp=2 under each schedule) and 2-D layouts (dp=2 x tp=2 under fsdp and
zero1, tp=2 x pp=2) beside the data-parallel rows of the same rank count, in the same
columns; they have no ZeRO formula (their bytes per rank depend on the stage and the tp
split), and their comm Φ counts the data-parallel collectives only (tp and pp move
activations, listed in the payload column). The default runs tp2 and pp2_1f1b.
With --device cuda, one-rank rows compare fp32, tf32, bf16, fp16 and fp8 too; a precision
the GPU refuses shows as n/a with the reason.

    python benchmarks/strategies.py                                 # CPU: 2 and 4 ranks, all
    python benchmarks/strategies.py --ranks 2 --strategies ddp,zero3,fsdp --steps 20
    python benchmarks/strategies.py --layouts all                   # + every tp / pp / 2-D row
    python benchmarks/strategies.py --device cuda --ranks 1         # one GPU: + precisions
    python benchmarks/strategies.py --ranks 4 --set model.n_layers=8  # any train.py override
    python benchmarks/strategies.py --moe-peer       # + MoE: ours vs DeepSpeed-MoE (moe_peer.py)
    python benchmarks/strategies.py --ranks 4 --moe-peer --moe-ep 2  # its rows at ep 2 (edp 2)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import moe_peer_table as moe_table
from bench_device import bench_device
from strategy_runs import (
    DEFAULT_LAYOUTS,
    LAYOUTS,
    MB,
    PP_MICROBATCHES,
    STRATEGIES,
    Job,
    machine,
    peak_cells,
    run_job,
    threads_per_rank,
    wait_for_quiet,
)

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
KIND_SHORT = {
    "all_reduce": "AR",
    "reduce_scatter": "RS",
    "all_gather": "AG",
    "broadcast": "BC",
    "send_activations": "act",
    "send_gradients": "grad",
}


COLUMNS = (
    "ranks",
    "strategy",
    "median step ms",
    "vs ddp",
    "others' CPU",
    "params MB",
    "grads MB",
    "optim MB",
    "total MB",
    "ZeRO formula (bytes/param)",
    "step peak MB (max rank)",
    "rank 0 peak MB (P/G/O/A/other, phase)",
    "comm / step (payload MB)",
    "comm Φ",
    "paper Φ",
    "loss",
)


LEGEND = (
    "MB columns: measured on rank 0 [the ZeRO paper's formula, Φ = n_params]; vs ddp: step "
    "time / ddp's at the same rank count; others' CPU: cores that other processes used "
    "during the row (re-take rows where it is not ~0); comm: payload per step per rank "
    "(AR all-reduce, RS reduce-scatter, AG all-gather; tp: tensor parallel's, on the tp group; "
    "pp act / grad: activations sent forward / gradients sent back over a stage boundary); "
    "step peak: the peak tracker's high-water mark of live tensor bytes in a training step "
    "(P params, G grads, O optimizer states, A activations, other: buckets, temporaries); "
    "comm Φ: elements the data-parallel collectives move per rank / Φ (an all-reduce counts "
    "twice); loss: final training loss (same data, same work). Layout rows (tp, pp, dp x tp, "
    "tp x pp) have no ZeRO formula: rank 0's bytes depend on its stage and tp split."
)


def _mb(measured: float, expected: float | None) -> str:
    if expected is None:
        return f"{measured / MB:.2f}"
    return f"{measured / MB:.2f} [{expected / MB:.2f}]"


def _kind(kind: str) -> str:
    """``all_reduce`` -> AR, ``tp.all_reduce`` -> tp AR, ``pp.send_activations`` -> pp act."""
    prefix, _, base = kind.rpartition(".")
    return f"{prefix} {KIND_SHORT.get(base, base)}".strip()


def strategy_cells(r: dict, ddp: dict | None) -> list[str]:
    head = [str(r["ranks"]), r["strategy"]]
    if not r["ok"]:
        return [*head, f"failed: {r['error']}", *[""] * (len(COLUMNS) - 3)]
    ms = r["model_state_bytes"]
    f = r["formula_bytes"] or dict.fromkeys(("params", "grads", "optimizer_states", "total"))
    total = sum(ms.values())
    vs = f"{r['median_ms'] / ddp['median_ms']:.2f}x" if ddp and ddp.get("ok") else "-"
    sent = r["comm_bytes_per_step"]
    comm = ", ".join(f"{_kind(k)} {v / MB:.2f}" for k, v in sorted(sent.items()) if v >= 1000)
    expr = f"{f['expr']} = {f['phi_per_rank']:.1f}Φ" if r["formula_bytes"] else "-"
    paper = "-" if r["paper_comm_phi"] is None else f"{r['paper_comm_phi']}Φ"
    return [
        *head,
        f"{r['median_ms']:.0f}",
        vs,
        f"{r['others_cpu']:.2f}",
        _mb(ms["params"], f["params"]),
        _mb(ms["grads"], f["grads"]),
        _mb(ms["optimizer_states"], f["optimizer_states"]),
        _mb(total, f["total"]),
        expr,
        f"{r['peak_memory_bytes'] / MB:.2f}",
        peak_cells(r["memory_peak"]),
        comm or "-",
        f"{r['comm_phi']:.2f}Φ",
        paper,
        f"{r['final_train_loss']:.3f}",
    ]


def precision_cells(r: dict, fp32: dict | None) -> list[str]:
    if not r["ok"]:
        return [r["precision"], f"n/a ({r['error']})", *[""] * (len(PRECISION_COLUMNS) - 2)]
    vs = f"{r['median_ms'] / fp32['median_ms']:.2f}x" if fp32 and fp32.get("ok") else "-"
    return [
        r["precision"],
        f"{r['median_ms']:.1f}",
        vs,
        f"{r['others_cpu']:.2f}",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['peak_memory_bytes'] / 2**20:,.0f}",
        f"{r['final_train_loss']:.3f}",
    ]


PRECISION_COLUMNS = (
    "precision",
    "median step ms",
    "vs fp32",
    "others' CPU",
    "tokens/s",
    "peak MiB",
    "loss",
)


def strategy_rows(results: list[dict]) -> list[list[str]]:
    ddp = {r["ranks"]: r for r in results if r["strategy"] == "ddp"}
    return [strategy_cells(r, ddp.get(r["ranks"])) for r in results]


def precision_rows(results: list[dict]) -> list[list[str]]:
    fp32 = next((r for r in results if r["precision"] == "fp32"), None)
    return [precision_cells(r, fp32) for r in results]


def print_table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < 2 or "formula" in col else "right")
    for cells in rows:
        table.add_row(*cells)
    Console(width=250).print(table)


def markdown(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> str:
    align = ["---" if i < 2 or "formula" in c else "---:" for i, c in enumerate(columns)]
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


# ---- the command line -----------------------------------------------------------------
def _moe_eps(text: str, rank_counts: list[int]) -> list[int]:
    """--moe-ep's sizes ([] for ep = ranks); each must divide every rank count."""
    try:
        eps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--moe-ep={text!r}: use a comma list of positive integers") from None
    for ep in eps:
        if bad := [n for n in rank_counts if ep < 1 or n % ep]:
            raise SystemExit(
                f"--moe-ep={ep} does not divide --ranks {bad[0]}; give ep sizes that divide "
                "every rank count"
            )
    return eps


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"--ranks={text!r}: use a comma list of positive integers")
    return values


def _strategies(text: str) -> list[str]:
    out = []
    for v in (v.strip() for v in text.split(",") if v.strip()):
        names = [f"deepspeed{s}" for s in (1, 2, 3)] if v == "deepspeed" else [v]
        bad = [n for n in names if n not in STRATEGIES]
        if bad:
            raise SystemExit(f"--strategies: {v!r} is unknown; use {', '.join(STRATEGIES)}")
        out += names
    return out


def _layouts(text: str) -> list[str]:
    if text == "all":
        return list(LAYOUTS)
    if text == "none":
        return []
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: {bad} unknown; use all, none or some of {', '.join(LAYOUTS)}")
    return names


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--ranks", default="2,4", help="comma list of rank counts (default 2,4)")
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma list; 'deepspeed' means deepspeed1,deepspeed2,deepspeed3",
    )
    p.add_argument(
        "--layouts",
        default=DEFAULT_LAYOUTS,
        help=f"tensor / pipeline / 2-D rows, each at its own rank count: a comma list of "
        f"{', '.join(LAYOUTS)}; all; none (default {DEFAULT_LAYOUTS})",
    )
    p.add_argument("--model", default=None, help="CPU default gpt2-mini, GPU gpt2-small")
    p.add_argument("--data", default="stdlib", help="the data config group (default stdlib)")
    p.add_argument("--tokenizer", default="byte", help="data.tokenizer (byte: vocab 256)")
    p.add_argument("--seq-len", type=int, default=None, help="CPU default 256, GPU 1024")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (CPU 8)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per timing pass")
    p.add_argument(
        "--measure-steps",
        type=int,
        default=3,
        help="steps of each row's measuring pass (collectives counted, peaks tracked)",
    )
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--precision", default=None, help="strategy rows (CPU fp32, GPU bf16)")
    p.add_argument("--val-samples", type=int, default=8, help="the final evaluation's samples")
    p.add_argument("--threads", type=int, default=None, help="per rank (default cores // ranks)")
    p.add_argument(
        "--retake-above",
        type=float,
        default=0.25,
        help="run a row again when other processes used more CPU cores than this meanwhile",
    )
    p.add_argument("--retakes", type=int, default=1, help="how many times at most (0: never)")
    p.add_argument(
        "--quiet-wait", type=int, default=60, help="seconds a retake waits for a quiet machine"
    )
    p.add_argument("--timeout", type=int, default=300, help="seconds before a row is killed")
    p.add_argument(
        "--out", default="outputs/bench_strategies.json", help="JSON results ('' for none)"
    )
    p.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    p.add_argument("--keep-runs", default=None, help="keep run directories here (default: temp)")
    p.add_argument(
        "--moe-peer",
        action="store_true",
        help="add the table 'MoE: ours vs DeepSpeed-MoE' (benchmarks/moe_peer.py): our expert\n"
        "parallelism (zero2, ep_size = --moe-ep) beside deepspeed.moe.layer.MoE at each --ranks",
    )
    p.add_argument(
        "--moe-ep",
        default="",
        help="the MoE table's expert-parallel sizes, comma-separated, each run at every --ranks\n"
        "count, each of which it must divide (edp = ranks / ep); default: ep = ranks",
    )
    p.add_argument("--moe-model", default="moe-tiny", help="the MoE table's model (moe-tiny)")
    p.add_argument("--moe-seq-len", type=int, default=256, help="the MoE table's seq len (256)")
    p.add_argument(
        "--moe-ds-modes",
        default="dropless,full_capacity",
        help="DeepSpeed-MoE rows: dropless (drop_tokens=False), full_capacity (capacity_factor=E/k)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a train.py override for every row, after the benchmark's own (repeatable)",
    )
    a = p.parse_args(argv)
    a.device = bench_device(a.device)
    gpu = a.device == "cuda"
    a.model = a.model or ("gpt2-small" if gpu else "gpt2-mini")
    a.seq_len = a.seq_len or (1024 if gpu else 256)
    a.global_batch = a.global_batch or 8
    a.precision = a.precision or ("bf16" if gpu else "fp32")
    a.rank_counts = _ints(a.ranks)
    a.strategy_names = _strategies(a.strategies)
    a.layout_names = _layouts(a.layouts)
    a.moe_ds_modes = [m.strip() for m in a.moe_ds_modes.split(",") if m.strip()]
    a.moe_eps = _moe_eps(a.moe_ep, a.rank_counts)
    if a.moe_peer:
        from moe_peer import DS_MODES

        if bad := [m for m in a.moe_ds_modes if m not in DS_MODES]:
            raise SystemExit(f"--moe-ds-modes: {bad} unknown; use some of {', '.join(DS_MODES)}")
        if (a.device, a.precision) != ("cpu", "fp32"):
            raise SystemExit("--moe-peer runs on CPU ranks (gloo) in fp32; add --device cpu")
    if a.steps <= a.warmup + 1:
        raise SystemExit(f"--steps={a.steps} must exceed --warmup={a.warmup} by at least 2")
    bad = [n for n in a.rank_counts if a.global_batch % n]
    if bad:
        raise SystemExit(f"--global-batch={a.global_batch} must divide by every rank count {bad}")
    for name in a.layout_names:
        layout = LAYOUTS[name]
        micro = PP_MICROBATCHES if layout.pp > 1 else 1
        if a.global_batch % (layout.dp * micro):
            raise SystemExit(
                f"--global-batch={a.global_batch} must divide into dp={layout.dp} x "
                f"{micro} micro-batches for layout {name}; use a multiple of {layout.dp * micro}"
            )
    return a


def run_and_report(a: argparse.Namespace, job: Job, root: Path, retake: bool = False) -> dict:
    r = run_job(a, job, root)
    status = f"{r['median_ms']:.0f} ms" if r["ok"] else f"failed: {r['error']}"
    label = f"{'retake ' if retake else ''}{job.ranks} ranks {job.strategy:>10} {job.precision:>4}"
    others = f", others' CPU {r['others_cpu']:.2f}" if "others_cpu" in r else ""
    print(f"{label}: {status} ({r.get('wall_s', 0):.0f} s{others})", flush=True)
    return r


def jobs_of(a: argparse.Namespace) -> list[Job]:
    """Strategy rows at each rank count, each count's layout rows after its strategies."""
    jobs = [Job(name, n, a.precision) for n in a.rank_counts for name in a.strategy_names]
    jobs += [Job(name, LAYOUTS[name].ranks, a.precision) for name in a.layout_names]
    return sorted(jobs, key=lambda job: job.ranks)  # stable: the order above within a count


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    root = Path(a.keep_runs) if a.keep_runs else Path(tempfile.mkdtemp(prefix="bench-strat-"))
    load_before = os.getloadavg()
    start = time.perf_counter()
    jobs = jobs_of(a)
    if a.device == "cuda":
        jobs += [Job("single", 1, name) for name in PRECISIONS]
    rows = [run_and_report(a, job, root) for job in jobs]
    for _ in range(a.retakes):
        # A shared machine: rows another job slowed down are run again, the cleaner kept.
        again = [i for i, r in enumerate(rows) if r["ok"] and r["others_cpu"] > a.retake_above]
        for i in again:
            wait_for_quiet(a)
            r = run_and_report(a, jobs[i], root, retake=True)
            if r["ok"] and r["others_cpu"] < rows[i]["others_cpu"]:
                rows[i] = r
    moe = []
    if a.moe_peer:
        import moe_peer

        moe = moe_peer.run_rows(a, root)
    results = [r for job, r in zip(jobs, rows, strict=True) if job.strategy != "single"]
    precision = [r for job, r in zip(jobs, rows, strict=True) if job.strategy == "single"]
    wall = time.perf_counter() - start
    counts = sorted({job.ranks for job in jobs if job.strategy != "single"})
    threads = ", ".join(f"{threads_per_rank(a, n)} at {n} ranks" for n in counts)
    title = (
        f"{a.model}, global batch {a.global_batch} x seq {a.seq_len} ({a.tokenizer} tokens), "
        f"{a.precision}, {a.device}, median of steps {a.warmup + 1}-{a.steps}, threads per "
        f"rank {threads}; {machine(results)}; load average {load_before[0]:.2f} at start; "
        f"{wall / 60:.1f} min"
    )
    if jobs:
        print_table(title, COLUMNS, strategy_rows(results))
        print(LEGEND)
    if moe:
        print_table(moe_table.title(a, moe), moe_table.COLUMNS, moe_table.table_rows(moe))
        print(moe_table.LEGEND)
    ptitle = f"One rank, {a.model}, batch {a.global_batch} x seq {a.seq_len}, {a.device}"
    if precision:
        print_table(ptitle, PRECISION_COLUMNS, precision_rows(precision))
    elif jobs:
        print("GPU precision comparison (fp32/tf32/bf16/fp16/fp8) skipped: --device cpu.")
    if a.out:
        payload = {"args": {k: v for k, v in vars(a).items()}, "title": title, "wall_s": wall}
        payload.update(load_before=load_before, load_after=os.getloadavg())
        payload.update(strategies=results, precisions=precision)
        if a.moe_peer:
            payload["moe"] = moe
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(payload, indent=2, default=str))
    if a.markdown:
        text = (
            markdown(title, COLUMNS, strategy_rows(results)) + "\n" + LEGEND + "\n" if jobs else ""
        )
        if precision:
            text += "\n" + markdown(ptitle, PRECISION_COLUMNS, precision_rows(precision))
        if moe:
            rows = moe_table.table_rows(moe)
            text += "\n" + markdown(moe_table.title(a, moe), moe_table.COLUMNS, rows)
            text += "\n" + moe_table.LEGEND + "\n"
        Path(a.markdown).write_text(text)
    if not a.keep_runs:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
