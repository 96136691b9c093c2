"""One training step of our model against transformers' at the same shape, side by side.

A step is forward, cross-entropy (fp32 logits), backward and AdamW; both models get the same
shape, random weights, input batch, autocast policy and optimizer. Every row runs in a fresh
process, so its peak memory is its own (CUDA allocator peak on GPU; on CPU the peak process
RSS minus the RSS before the model was built, i.e. model state plus the step's activations).

    python benchmarks/step_vs_transformers.py                        # GPU: bf16 x sdpa x compile off,on
    python benchmarks/step_vs_transformers.py --device cpu           # CPU: gpt2-mini, vocab 8192, seq 256
    python benchmarks/step_vs_transformers.py --attention sdpa,eager --compile off
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.nn.functional as F
from bench_device import bench_device

from benchmarks.timing import one_call_s
from llm.models import MODEL_SHAPES, ModelArgs, build_model, materialize, model_args
from llm.models.hf_config import hf_config

IMPLS = ("ours", "transformers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    impl: str
    attention: str
    dtype: str
    compile: bool
    device: str
    args: ModelArgs
    batch: int
    seq_len: int
    steps: int
    warmup: int
    threads: int | None


def _build(row: Row) -> torch.nn.Module:
    if row.impl == "ours":
        return materialize(build_model(row.args, row.attention), row.device, seed=0)
    from transformers import AutoModelForCausalLM

    cfg = hf_config(row.args)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=row.attention)
    return model.to(row.device)


def run_row(row: Row) -> dict:
    """Build, warm up and time one configuration; runs in its own process."""
    if row.threads:
        torch.set_num_threads(row.threads)
    torch.manual_seed(0)
    base_rss = psutil.Process().memory_info().rss
    if row.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = _build(row).train()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_model = torch.compile(model) if row.compile else model
    data = torch.randint(0, row.args.vocab_size, (row.batch, row.seq_len + 1), device=row.device)
    inputs, targets = data[:, :-1], data[:, 1:]  # (B, T) each
    autocast = torch.autocast(row.device, DTYPES[row.dtype], enabled=row.dtype != "fp32")

    def step() -> None:
        with autocast:
            out = step_model(inputs) if row.impl == "ours" else step_model(inputs, use_cache=False)
            logits = out if row.impl == "ours" else out.logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(row.warmup):
        step()
    # One step per timing: torch.utils.benchmark synchronises CUDA before and after it.
    times = [one_call_s(step) for _ in range(row.steps)]
    if row.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:  # ru_maxrss is KiB on Linux; the process is fresh, so its peak is this row's
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    return {"times": times, "peak": peak, "params": n_params}


def _in_fresh_process(row: Row) -> dict:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(run_row, row).result()


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise SystemExit(f"{flag}={text!r}: use a comma list of {', '.join(allowed)}")
    return values


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Row]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--model", default=None, help="a registered shape (GPU default gpt2-small, CPU gpt2-mini)"
    )
    p.add_argument("--vocab-size", type=int, default=None, help="CPU default 8192, GPU the shape's")
    p.add_argument("--batch", type=int, default=None, help="GPU default 8, CPU 4")
    p.add_argument("--seq-len", type=int, default=None, help="GPU default 1024, CPU 256")
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 20, CPU 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (GPU 5, CPU 3)")
    p.add_argument("--dtype", default=None, help="comma list of fp32,bf16 (GPU bf16, CPU fp32)")
    p.add_argument("--compile", default=None, help="comma list of off,on (GPU off,on; CPU off)")
    p.add_argument("--attention", default="sdpa", help="comma list of sdpa,eager")
    p.add_argument("--impl", default=",".join(IMPLS), help="comma list of ours,transformers")
    p.add_argument(
        "--rounds", type=int, default=None, help="interleaved passes over the rows (GPU 1, CPU 3)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = p.parse_args(argv)
    a.device = bench_device(a.device)
    gpu = a.device == "cuda"
    a.model = a.model or ("gpt2-small" if gpu else "gpt2-mini")
    if a.model not in MODEL_SHAPES:
        raise SystemExit(f"--model={a.model!r} is unknown; choose one of {', '.join(MODEL_SHAPES)}")
    a.vocab_size = a.vocab_size or (None if gpu else 8192)
    a.batch = a.batch or (8 if gpu else 4)
    a.seq_len = a.seq_len or (1024 if gpu else 256)
    a.steps = a.steps or (20 if gpu else 10)
    a.warmup = a.warmup if a.warmup is not None else (5 if gpu else 3)
    # On a shared CPU box load comes and goes; interleaving rows spreads it over all of them.
    a.rounds = a.rounds or (1 if gpu else 3)
    # Longer sequences than the shape allows grow its position table (GPT-2), for both impls.
    max_seq_len = max(MODEL_SHAPES[a.model].max_seq_len, a.seq_len)
    args = model_args(a.model, vocab_size=a.vocab_size, max_seq_len=max_seq_len)
    rows = [
        Row(
            impl,
            attn,
            dtype,
            comp == "on",
            a.device,
            args,
            a.batch,
            a.seq_len,
            a.steps,
            a.warmup,
            a.threads,
        )
        for dtype in _choices(a.dtype or ("bf16" if gpu else "fp32"), tuple(DTYPES), "--dtype")
        for attn in _choices(a.attention, ("sdpa", "eager"), "--attention")
        for comp in _choices(a.compile or ("off,on" if gpu else "off"), ("off", "on"), "--compile")
        for impl in _choices(a.impl, IMPLS, "--impl")
    ]
    return a, rows


def print_table(a: argparse.Namespace, results: list[dict]) -> None:
    import transformers
    from rich.console import Console
    from rich.table import Table

    memory = "peak CUDA alloc MiB" if a.device == "cuda" else "peak RSS growth MiB"
    args = results[0]["args"]
    title = (
        f"{a.model} (vocab {args['vocab_size']}, d_model {args['d_model']}, "
        f"{args['n_layers']} layers), batch {a.batch} x seq {a.seq_len}, {a.device}, "
        f"{a.rounds} round(s) of {a.steps} timed steps after {a.warmup} warm-up, "
        f"{torch.get_num_threads() if a.threads is None else a.threads} threads; "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    table = Table(title=title, title_justify="left")
    for col in ("implementation", "attention", "dtype", "compile"):
        table.add_column(col)
    for col in ("median step ms", "min step ms", "tokens/s"):
        table.add_column(col, justify="right")
    for col in (memory, "params", "vs transformers"):
        table.add_column(col, justify="right")
    by_key = {(r["impl"], r["attention"], r["dtype"], r["compile"]): r for r in results}
    for r in results:
        peer = by_key.get(("transformers", r["attention"], r["dtype"], r["compile"]))
        ratio = f"{peer['median_ms'] / r['median_ms']:.2f}x" if peer else "-"
        table.add_row(
            r["impl"],
            r["attention"],
            r["dtype"],
            "on" if r["compile"] else "off",
            f"{r['median_ms']:.1f}",
            f"{r['min_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['peak_mib']:,.0f}",
            f"{r['params']:,}",
            ratio,
        )
    Console(width=200).print(table)


def measure(rows: list[Row], rounds: int) -> list[dict]:
    """Run every row ``rounds`` times, interleaved; pool the timed steps of all rounds."""
    runs = [[_in_fresh_process(row) for row in rows] for _ in range(rounds)]
    results = []
    for i, row in enumerate(rows):
        times = [t for rnd in runs for t in rnd[i]["times"]]
        median = statistics.median(times)
        results.append({
            **asdict(row),
            "median_ms": median * 1e3,
            "min_ms": min(times) * 1e3,
            "tokens_per_s": row.batch * row.seq_len / median,
            "peak_mib": max(rnd[i]["peak"] for rnd in runs) / 2**20,
            "params": runs[0][i]["params"],
        })  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    a, rows = parse(argv)
    print_table(a, measure(rows, a.rounds))


if __name__ == "__main__":
    main()
