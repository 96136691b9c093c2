"""KV-cache decoding: tokens/s of a llama-shaped stack in bf16, a contiguous cache against a
paged one read by each kernel (gather, our Triton kernel, FlexAttention), at batch 1, 16 and
64 after a 1024-token prompt; then the same stack at MHA, GQA (n_heads / 4) and MQA kv heads
with the paged Triton kernel (gather in the dry run): bytes per cached token (2 x layers x kv heads x head_dim x 2
bytes, against the cache's own nbytes / capacity) and tokens/s.

decode_tok_s is the engine's: ``generate``'s decode tokens over its decode seconds (greedy,
every sequence to the same length), Python included. attn_us is one layer's decode attention
alone, ``cache.attend`` on a cache holding the same sequences (the block table and lengths
are built once per step, for every layer, and are not timed), after each kernel has compiled
for the shape in a warm-up generation.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_pass.common import Result, deadline, device, write_partial_rows
from benchmarks.timing import mean_back_to_back_us
from llm.errors import ConfigError
from llm.inference.generate import build_cache, generate
from llm.inference.kv_cache import kv_bytes_per_token
from llm.inference.paged_attention import resolve_kernel
from llm.inference.sampling import SamplingParams
from llm.models import build_model, materialize, model_args

GPU = {"model": "llama-1b", "layers": 4, "batches": (1, 16, 64), "prompt": 1024, "new": 32,
       "block": 16, "sweep_batch": 64, "dtype": torch.bfloat16, "min_run_time": 0.1}  # fmt: skip
DRY = {"model": "llama-tiny", "layers": 2, "batches": (1, 4), "prompt": 32, "new": 4,
       "block": 16, "sweep_batch": 4, "dtype": torch.float32, "min_run_time": 0.01}  # fmt: skip
CACHES = (("contiguous", "-"), ("paged", "gather"), ("paged", "triton"), ("paged", "flex"))
GREEDY = SamplingParams(temperature=0.0)


def _model(s: dict, dev: torch.device, n_kv_heads: int | None = None):
    args = model_args(s["model"], n_layers=s["layers"], n_kv_heads=n_kv_heads,
                      max_seq_len=s["prompt"] + s["new"])  # fmt: skip
    return materialize(build_model(args), dev, seed=0).to(s["dtype"]).eval()


def _decode(model, s: dict, batch: int, paged: bool, kernel: str) -> dict:
    """One warm-up generation of short prompts into a cache of the measured one's size (the
    kernels compile for its shapes), then the measured generation and one layer's attend."""
    vocab, length = model.args.vocab_size, s["prompt"] + s["new"]
    slots = -(-length // s["block"]) * s["block"]  # whole blocks: no preemption
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, s["prompt"]), generator=g).tolist()
    common = {"paged": paged, "block_size": s["block"], "cache_tokens": batch * slots,
              "kernel": "gather" if kernel == "-" else kernel}  # fmt: skip
    generate(model, [p[:16] for p in prompts], 2, GREEDY, None, **common)
    gen = generate(model, prompts, s["new"], GREEDY, None, **common)
    cache = build_cache(model, [length] * batch, paged, s["block"], batch * slots, common["kernel"])
    for seq in range(batch):
        cache.add(seq, length)
        cache.lens[seq] = length - 1  # the step's one new token makes the whole sequence
    cache.kv.normal_()
    a, kv = model.args, cache.kv
    # (B, 1, H, D) transposed, as the model's projection makes it: the compiled flex call
    # guards on q's strides, so this reuses the generation's compile.
    q = torch.randn(batch, 1, a.n_heads, a.head_dim, device=kv.device, dtype=kv.dtype).transpose(
        1, 2
    )
    cache.begin_step(list(range(batch)), 1, kv.device)  # once per step, not timed
    us = mean_back_to_back_us(lambda: cache.attend(0, q), s["min_run_time"])
    return {
        "decode_tok_s": gen.stats.tokens_per_s()["decode"],
        "attn_us": us,
        "bytes_per_token": kv_bytes_per_token(model.args, s["dtype"]),
        "cache_bytes_per_slot": cache.nbytes() / cache.capacity_tokens,
        "cache_mib": cache.nbytes() / 2**20,
    }


def _plan(s: dict, n_heads: int, dev) -> list[tuple[str, int | None, int, str, str]]:
    """(part, n_kv_heads, batch, cache, kernel) in the order they run; the kv-heads sweep
    reads with the default kernel (triton on CUDA, gather in the dry run)."""
    rows = [("cache", None, b, c, k) for b in s["batches"] for c, k in CACHES]
    kv = sorted({n_heads, max(1, n_heads // 4), 1}, reverse=True)
    sweep = resolve_kernel("auto", dev)
    return rows + [("kv_heads", n, s["sweep_batch"], "paged", sweep) for n in kv]


def run(dry: bool) -> Result:
    s, dev = (DRY if dry else GPU), device(dry)
    stop_at = deadline(reserve_s=20)
    base = _model(s, dev)
    models = {base.args.n_kv_heads: base}
    rows, notes, skipped = [], [], []
    for part, n_kv, batch, cache, kernel in _plan(s, base.args.n_heads, dev):
        label = f"{part} {cache}/{kernel} B={batch} kv_heads={n_kv or base.args.n_kv_heads}"
        if kernel not in ("-", "gather"):
            try:
                resolve_kernel(kernel, dev)
            except ConfigError as e:
                notes.append(f"{label}: not run: {e}")
                continue
            if dry and kernel == "flex":
                notes.append(
                    f"{label}: not run in the dry run (flex compiles ~20 s per batch on CPU)"
                )
                continue
        if time.monotonic() > stop_at:
            skipped.append(label)
            continue
        n_kv = n_kv or base.args.n_kv_heads
        if n_kv not in models:
            models = {base.args.n_kv_heads: base, n_kv: _model(s, dev, n_kv)}  # one extra at a time
        figures = _decode(models[n_kv], s, batch, cache == "paged", kernel)
        rows.append({"part": part, "cache": cache, "kernel": kernel, "n_kv_heads": n_kv,
                     "batch": batch, "context": s["prompt"] + s["new"], **figures})  # fmt: skip
        write_partial_rows(_result(rows, notes, skipped, s, base))
    return _result(rows, notes, skipped, s, base)


def _result(rows: list[dict], notes: list[str], skipped: list[str], s: dict, model) -> Result:
    a = model.args
    notes = notes + ([f"not run, past the time limit: {'; '.join(skipped)}"] if skipped else [])
    return Result(
        title="KV-cache decoding: contiguous against paged (gather, triton, flex); MHA/GQA/MQA",
        shapes=(
            f"{s['model']} shape with {s['layers']} layers (H={a.n_heads}, D={a.head_dim}), "
            f"{str(s['dtype']).removeprefix('torch.')}, prompts of {s['prompt']} tokens then "
            f"{s['new']} greedy tokens, blocks of {s['block']}; kv-heads sweep at batch "
            f"{s['sweep_batch']} with the paged triton kernel"
        ),
        columns=["part", "cache", "kernel", "n_kv_heads", "batch", "context", "decode_tok_s",
                 "attn_us", "bytes_per_token", "cache_bytes_per_slot", "cache_mib"],
        rows=rows,
        notes=notes,
    )  # fmt: skip
