"""What the kv_cache experiment measures on a job's final checkpoint (experiments/kv_cache.py
reports it): the cache's bytes as the live-tensor tracker counts them (llm.memory, outside
the cache's own arithmetic), decode tokens/s, and, on the MHA job, one mixed-length workload
served through the engine with a contiguous and with paged caches of the same bytes. Results
are cached as JSON in the job's folder, so writing the report again measures nothing.

Timings run on one CPU thread: on a shared 2-core machine OpenMP's spinning threads made a
decode step of this tiny model 20x slower and erratic (180 against 3,600 tokens/s measured).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from experiments.sweep import Job
from llm.inference.engine import Engine, Request
from llm.inference.generate import generate
from llm.inference.kv_cache import ContiguousKVCache, PagedKVCache, kv_bytes_per_token
from llm.inference.load import load_for_inference
from llm.inference.sampling import Sampler, SamplingParams
from llm.memory import PeakTracker
from llm.models import ModelArgs, Transformer

VERSION = 1  # raise when what is measured changes: older cached results are measured again
MEASURED = "kv_cache.json"  # per job: bytes, budget, decode tokens/s
SERVED = "kv_paging.json"  # the MHA job: the workload through each cache
GREEDY = SamplingParams(temperature=0.0)
DECODE = (8, 32, 64)  # prompts, tokens per prompt, new tokens: the decode tokens/s batch
REPEATS = 3  # decode tokens/s: the median of this many runs
BUDGET_SEQUENCES = 2  # the memory budget: MHA's cache for this many max_seq_len sequences
# The workload: ShareGPT's mean prompt and output lengths (Kwon et al., 2023, Fig. 11) scaled
# by max_seq_len / OPT's 2048-token context, drawn log-normal (sigma 1: ShareGPT's long tail).
SHAREGPT_MEANS = (161.31, 337.99)
PAPER_CONTEXT = 2048
SIGMA = 1.0
N_REQUESTS = 200
ROWS = 8  # the KV budget of the workload: this many max_seq_len rows (Orca (Max)'s reservation)
VLLM_BLOCK = 16  # vLLM's default block size


def device_for(job: Job) -> torch.device:
    trained_on = str(job.summary.get("device", "cpu"))
    return torch.device(
        "cuda" if trained_on.startswith("cuda") and torch.cuda.is_available() else "cpu"
    )


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_model(job: Job, device: torch.device) -> Transformer:
    """The job's newest verified checkpoint; bf16 on a GPU (as it trained), fp32 on a CPU."""
    model = load_for_inference(str(job.dir), None, device).model
    return model.to(torch.bfloat16) if device.type == "cuda" else model


def tracked_bytes(build: Callable[[], object], device: torch.device) -> tuple[object, int]:
    """What ``build()`` returns, and the bytes of the tensors it left alive, as the peak
    tracker's live-storage ledger counts them (every op output registered while it ran)."""
    tracker = PeakTracker(device)
    before = tracker.current
    with tracker.region("kv_cache"):
        built = build()
    return built, tracker.current - before


def budget_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """The stated budget: MHA's cache (every head its own K and V) for BUDGET_SEQUENCES
    sequences of max_seq_len, so every variant is measured against the same bytes."""
    mha = dataclasses.replace(args, n_kv_heads=args.n_heads)
    return BUDGET_SEQUENCES * args.max_seq_len * kv_bytes_per_token(mha, dtype)


def decode_rate(model: Transformer, batch: int, prompt_len: int, new: int) -> float:
    """Median decode tokens/s of greedy generation from ``batch`` fixed random prompts."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.args.vocab_size, (batch, prompt_len), generator=gen).tolist()
    rates = [
        generate(model, prompts, new, GREEDY, None).stats.tokens_per_s()["decode"]
        for _ in range(REPEATS)
    ]
    return statistics.median(rates)


def _cached(path: Path) -> dict | None:
    if not path.exists():
        return None
    found = json.loads(path.read_text())
    return found if found.get("version") == VERSION else None


def _save(path: Path, result: dict) -> dict:
    path.write_text(json.dumps({"version": VERSION, **result}))
    return result


def measure(job: Job) -> dict:
    """Bytes per token (formula, and measured on a contiguous cache of 4 rows and a paged
    pool of 64 blocks, each divided by its tokens), what the budget holds, decode tokens/s."""
    cached = _cached(job.dir / MEASURED)
    if cached is not None:
        return cached
    device = device_for(job)
    model = load_model(job, device)
    args, dtype = model.args, next(model.parameters()).dtype
    rows, blocks = 4, 64
    _, contiguous = tracked_bytes(
        lambda: ContiguousKVCache(args, rows, args.max_seq_len, dtype, device), device
    )
    _, paged = tracked_bytes(lambda: PagedKVCache(args, blocks, VLLM_BLOCK, dtype, device), device)
    per_token = contiguous / (rows * args.max_seq_len)
    budget = budget_bytes(args, dtype)
    batch = int(budget // (per_token * args.max_seq_len))
    with one_thread(device):
        rate = decode_rate(model, *DECODE)
        prompt = DECODE[1]
        at_budget = decode_rate(model, batch, prompt, args.max_seq_len - prompt) if batch else None
    return _save(
        job.dir / MEASURED,
        {
            "device": device.type,
            "n_heads": args.n_heads,
            "n_kv_heads": args.n_kv_heads,
            "dtype": str(dtype).removeprefix("torch."),
            "max_seq_len": args.max_seq_len,
            "formula": kv_bytes_per_token(args, dtype),
            "contiguous": per_token,
            "paged": paged / (blocks * VLLM_BLOCK),
            "budget_bytes": budget,
            "budget_tokens": int(budget // per_token),
            "budget_batch": batch,
            "decode_tokens_per_s": rate,
            "budget_decode_tokens_per_s": at_budget,
        },
    )


# --- the paging workload -------------------------------------------------------------


def _draw(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    value = rng.lognormvariate(math.log(mean) - SIGMA**2 / 2, SIGMA)  # a log-normal of that mean
    return min(hi, max(lo, round(value)))


def workload(max_seq_len: int, n: int = N_REQUESTS, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, new tokens) of each request; together at most max_seq_len."""
    scale = max_seq_len / PAPER_CONTEXT
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = _draw(rng, SHAREGPT_MEANS[0] * scale, 1, max_seq_len - 1)
        out.append((prompt, _draw(rng, SHAREGPT_MEANS[1] * scale, 1, max_seq_len - prompt)))
    return out


def _reserved_by_free_lists(cache) -> int:
    """Tokens set aside for sequences, read off the free lists (not the per-sequence tables)."""
    if cache.paged:
        return (cache.allocator.n_blocks - cache.allocator.free_blocks) * cache.block_size
    return (cache.kv.shape[2] - len(cache.free_rows)) * cache.row_len


def _written_share(cache) -> float:
    """The share of the pool's token slots ever written: pools start as zeros, and a slot
    counts as written when any of its K or V values in any layer is not zero."""
    if cache.paged:  # (L, 2, Hkv, n_blocks, block_size, D) -> (n_blocks, block_size)
        written = cache.kv.ne(0).any(dim=5).any(dim=2).any(dim=1).any(dim=0)
    else:  # (L, 2, rows, Hkv, row_len, D) -> (rows, row_len)
        written = cache.kv.ne(0).any(dim=5).any(dim=3).any(dim=1).any(dim=0)
    return float(written.float().mean())


def _step_time_fit(steps: list[tuple[int, float]]) -> dict | None:
    """Decode step seconds = intercept + slope x batch, over the steps that prefilled nothing."""
    if len({b for b, _ in steps}) < 2:
        return None
    slope, intercept = statistics.linear_regression([b for b, _ in steps], [s for _, s in steps])
    return {"intercept_s": intercept, "per_request_s": slope}


def serve(model: Transformer, cache, lengths: list[tuple[int, int]]) -> dict:
    """Every request through the engine on ``cache``; each ends at its drawn length (no eos).
    Only engine steps are timed; the checks from outside the cache run between them."""
    device = next(model.parameters()).device
    engine = Engine(model, cache, Sampler(GREEDY, device))
    gen = torch.Generator().manual_seed(1)
    for i, (prompt, new) in enumerate(lengths):
        tokens = torch.randint(0, model.args.vocab_size, (prompt,), generator=gen).tolist()
        engine.submit(Request(i, tokens, new))
    seconds, batches, saturated, pure, audit = 0.0, [], [], [], []
    while engine.waiting or engine.running:
        prefilled, decoded = engine.stats.prefill_tokens, engine.stats.decode_tokens
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        seconds += took
        batch = engine.stats.decode_tokens - decoded
        if batch:
            batches.append(batch)
            saturated.append(bool(engine.waiting))  # the cache, not the queue, held requests back
            if engine.stats.prefill_tokens == prefilled:
                pure.append((batch, took))
        # Tokens cached per running request, counted from the requests: all but the newest.
        held = sum(len(r.tokens) - 1 for r in engine.running)
        audit.append((held, cache.used_tokens(), _reserved_by_free_lists(cache)))
    stats = engine.stats
    generated = sum(new for _, new in lengths)
    shares = [used / reserved for used, reserved in stats.occupancy]
    busy = [s for s, full in zip(shares, saturated, strict=True) if full]
    crowded = [b for b, full in zip(batches, saturated, strict=True) if full]
    return {
        "pool_tokens": cache.capacity_tokens,
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "decode_steps": len(batches),
        "mean_running": statistics.mean(batches),
        "mean_running_saturated": statistics.mean(crowded) if crowded else None,
        "max_running": stats.max_running,
        "preemptions": stats.preemptions,
        "prefill_tokens": stats.prefill_tokens,
        "prompt_tokens": sum(prompt for prompt, _ in lengths),
        "token_share": statistics.mean(shares),
        "token_share_saturated": statistics.mean(busy) if busy else None,
        "token_share_of_pool": statistics.mean(
            u / cache.capacity_tokens for u, _ in stats.occupancy
        ),
        "audit_share": statistics.mean(h / r for h, _, r in audit if r),
        "bookkeeping_agrees": all(held == used for held, used, _ in audit),
        "written_share": _written_share(cache),
        "step_time": _step_time_fit(pure),
        "occupancy": stats.occupancy,
        "batches": batches,
        "outputs": {r.id: r.out for r in engine.finished},
    }


def scaled_block(max_seq_len: int) -> int:
    """vLLM's block size scaled like the workload's lengths (16 x max_seq_len / 2048)."""
    return max(1, round(VLLM_BLOCK * max_seq_len / PAPER_CONTEXT))


def serve_all(job: Job) -> dict:
    """The workload through a contiguous cache of ROWS max_seq_len rows (each request reserves
    a whole row: the output length is unknown in advance), and through paged pools of the
    same bytes at vLLM's block size and at the scaled one."""
    cached = _cached(job.dir / SERVED)
    if cached is not None:
        return cached
    device = device_for(job)
    model = load_model(job, device)
    args, dtype = model.args, next(model.parameters()).dtype
    tokens = ROWS * args.max_seq_len
    lengths = workload(args.max_seq_len)
    builds = {
        "contiguous": lambda: ContiguousKVCache(args, ROWS, args.max_seq_len, dtype, device),
        **{
            f"paged_{b}": (lambda b=b: PagedKVCache(args, tokens // b, b, dtype, device))
            for b in dict.fromkeys((scaled_block(args.max_seq_len), VLLM_BLOCK))
        },
    }
    runs = {}
    with one_thread(device):
        for name, build in builds.items():
            cache, nbytes = tracked_bytes(build, device)
            runs[name] = {"pool_bytes": nbytes, **serve(model, cache, lengths)}
    reference = runs["contiguous"]["outputs"]
    for run in runs.values():
        outputs = run.pop("outputs")
        run["same_tokens"] = sum(outputs[i] == reference[i] for i in reference)
    return _save(
        job.dir / SERVED,
        {
            "max_seq_len": args.max_seq_len,
            "requests": len(lengths),
            "mean_prompt": statistics.mean(p for p, _ in lengths),
            "mean_new": statistics.mean(n for _, n in lengths),
            "runs": runs,
        },
    )
