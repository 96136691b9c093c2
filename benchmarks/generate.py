"""Greedy generation side by side, one run: transformers' ``generate`` (its default
DynamicCache) and ours (llm/inference/generate.py) with a contiguous and a paged KV cache
(the gather kernel), on the same random weights (a transformers model from a config, saved
and read back into ours with llm.models.from_hf).

    python benchmarks/generate.py                     # gpt2-mini shape, 8 x 64 prompt tokens, 64 new
    python benchmarks/generate.py --family llama      # the same width and depth, 2 kv heads (GQA)
    python benchmarks/generate.py --ragged --json generate.json

Prompts have equal lengths unless --ragged (lengths spread from half of --prompt to all of
it): transformers then gets them left-padded with an attention mask, ours unpadded.

Per row, the median over --repeats after one warm-up of every row (the rows take turns, so
load from elsewhere falls on all of them alike):
- prefill and decode tokens/s (prefill: the prompts' own tokens, not padding). Ours: the engine's own clocks (llm/inference/engine.py; it
  prefills each prompt alone, then decodes them together). Transformers prefills the batch
  in one forward, inside ``generate``: its prefill time is a whole ``generate`` call with
  max_new_tokens=1 (the prompt's forward and the first token), its decode time the full
  call's minus that, over the B x (N - 1) tokens decoded after the first.
- total wall time of one ``generate`` call (ours includes allocating its cache).
- the KV cache's bytes: ours ``kv_cache_bytes["allocated"]``; transformers' the key and value
  tensors of the returned cache (``return_dict_in_generate=True``), beside the formula
  2 x L x Hkv x D x bytes per element x tokens held, where the tokens held are B x
  (P + N - 1) for transformers (the last token is sampled, never fed back), B x (P + N) for
  our contiguous rows and each sequence's P + N rounded up to whole blocks for our paged pool.
- whether the new tokens equal transformers' (greedy: they should; a mismatch is shown, not
  raised: random weights leave near-ties that bf16 rounding can tip).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_device import bench_device

from benchmarks.timing import sync
from llm.errors import ConfigError
from llm.inference.generate import generate
from llm.inference.sampling import SamplingParams
from llm.models import ModelArgs, from_hf, model_args
from llm.models.hf_config import hf_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS = ("transformers", "ours, contiguous", "ours, paged")
TIMED = ("prefill_tok_s", "decode_tok_s", "total_s")  # the median of --repeats calls


def shape(family: str) -> ModelArgs:
    """gpt2-mini (d_model 128, 4 layers, 4 heads, vocabulary 4,096, 512 positions), or a Llama
    of the same width and depth with 2 kv heads."""
    if family == "gpt2":
        return model_args("gpt2-mini", dropout=0.0)
    return model_args(
        "llama-tiny", d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=512
    )


def build_pair(args: ModelArgs, dtype: torch.dtype, device: torch.device):
    """(transformers' model, ours) holding the same random weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(args, dtype), dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = from_hf(folder, "sdpa", device, dtype).eval()
    return hf.to(device), ours


def prompt_lengths(batch: int, prompt: int, ragged: bool) -> list[int]:
    if not ragged or batch == 1:
        return [prompt] * batch
    low = max(1, prompt // 2)
    return [low + i * (prompt - low) // (batch - 1) for i in range(batch)]


def kv_formula_bytes(args: ModelArgs, dtype: torch.dtype, tokens: int) -> int:
    """2 x L x Hkv x D x bytes per element x tokens."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype.itemsize * tokens


def kv_tokens_held(lengths: list[int], new: int, block_size: int) -> dict[str, int]:
    """Tokens each row's cache holds at the end: transformers' padded batch, our contiguous
    rows of the longest sequence, our paged blocks."""
    longest = [n + new for n in lengths]
    return {
        "transformers": len(lengths) * (max(lengths) + new - 1),
        "ours, contiguous": len(lengths) * max(longest),
        "ours, paged": sum(math.ceil(n / block_size) * block_size for n in longest),
    }


def hf_cache_bytes(cache) -> int:
    """Bytes of the key and value tensors of a transformers Cache (5.x: ``cache.layers``)."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))


class Runner:
    """Each row's one timed call: seconds and what it measured."""

    def __init__(self, hf, ours, prompts: list[list[int]], new: int, block_size: int) -> None:
        self.hf, self.ours, self.prompts, self.new = hf, ours, prompts, new
        self.block_size = block_size
        self.device = next(ours.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding: transformers appends new tokens after the last column.
        padded = [[0] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        self.ids = torch.tensor(padded, device=self.device)  # (B, P)
        self.mask = torch.tensor(mask, device=self.device)  # (B, P)

    def _hf_call(self, new: int):
        sync(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.hf.generate(
                self.ids,
                attention_mask=self.mask,
                do_sample=False,
                min_new_tokens=new,
                max_new_tokens=new,
                pad_token_id=0,
                return_dict_in_generate=True,
            )
        sync(self.device)
        return time.perf_counter() - start, out

    def transformers(self) -> dict:
        prefill_s, _ = self._hf_call(1)
        total_s, out = self._hf_call(self.new)
        batch, width = self.ids.shape
        return {  # prompt tokens: the padding's are computed too, but not counted
            "prefill_tok_s": int(self.mask.sum()) / prefill_s,
            "decode_tok_s": batch * (self.new - 1) / (total_s - prefill_s)
            if self.new > 1
            else None,
            "total_s": total_s,
            "kv_bytes": hf_cache_bytes(out.past_key_values),
            "tokens": out.sequences[:, width:].tolist(),
        }

    def ours_row(self, paged: bool) -> dict:
        sync(self.device)
        start = time.perf_counter()
        g = generate(
            self.ours,
            self.prompts,
            self.new,
            SamplingParams(temperature=0),
            None,
            paged=paged,
            block_size=self.block_size,
            kernel="gather",
        )
        sync(self.device)
        total_s = time.perf_counter() - start
        rates = g.stats.tokens_per_s()
        return {
            "prefill_tok_s": rates["prefill"],
            "decode_tok_s": rates["decode"],
            "total_s": total_s,
            "kv_bytes": g.kv_cache_bytes["allocated"],
            "tokens": g.tokens,
        }

    def run(self, row: str) -> dict:
        if row == "transformers":
            return self.transformers()
        return self.ours_row(paged=row == "ours, paged")


def _median(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)


def measure(a: argparse.Namespace) -> dict:
    device, dtype, args = torch.device(a.device), DTYPES[a.dtype], shape(a.family)
    if a.prompt + a.new > args.max_seq_len:
        raise ConfigError(
            f"--prompt {a.prompt} + --new {a.new} is past the model's {args.max_seq_len} "
            "positions; lower them"
        )
    hf, ours = build_pair(args, dtype, device)
    lengths = prompt_lengths(a.batch, a.prompt, a.ragged)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    runner = Runner(hf, ours, prompts, a.new, a.block_size)
    for row in ROWS:  # warm-up: first-call allocations and kernel selection
        runner.run(row)
    runs = {row: [] for row in ROWS}
    for _ in range(a.repeats):
        for row in ROWS:
            runs[row].append(runner.run(row))
    held = kv_tokens_held(lengths, a.new, a.block_size)
    reference = runs["transformers"][-1]["tokens"]
    rows = []
    for row, results in runs.items():
        timed = {k: _median([r[k] for r in results]) for k in TIMED}
        rows.append({
            "impl": row,
            **timed,
            "kv_bytes": results[-1]["kv_bytes"],
            "kv_tokens": held[row],
            "kv_formula_bytes": kv_formula_bytes(args, dtype, held[row]),
            "tokens_equal": all(r["tokens"] == reference for r in results),
        })  # fmt: skip
    config = {**vars(a), "prompt_lengths": lengths, "n_layers": args.n_layers}
    config |= {"n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim}
    return {"config": config, "rows": rows}


def print_table(result: dict) -> None:
    import transformers
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    prompts = "ragged " + "-".join(map(str, c["prompt_lengths"][:: max(1, c["batch"] - 1)]))
    title = (
        f"{c['family']} (L {c['n_layers']}, Hkv {c['n_kv_heads']}, D {c['head_dim']}), "
        f"{c['dtype']}, batch {c['batch']} x {prompts if c['ragged'] else c['prompt']} prompt "
        f"tokens + {c['new']} new, greedy; {c['device']}, {torch.get_num_threads()} threads; "
        f"median of {c['repeats']} after a warm-up; paged block {c['block_size']}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("implementation")
    for col in ("prefill tok/s", "decode tok/s", "total s", "KV tokens held", "KV bytes"):
        table.add_column(col, justify="right")
    table.add_column("2·L·Hkv·D·bytes·tokens", justify="right")
    table.add_column("tokens = transformers'")
    for r in result["rows"]:
        table.add_row(
            r["impl"],
            f"{r['prefill_tok_s']:,.0f}",
            "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:,.0f}",
            f"{r['total_s']:.3f}",
            f"{r['kv_tokens']:,}",
            f"{r['kv_bytes']:,}",
            f"{r['kv_formula_bytes']:,}",
            "yes" if r["tokens_equal"] else "NO: differ",
        )
    Console(width=200).print(table)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    p.add_argument("--prompt", type=int, default=64, help="tokens per prompt (--ragged: longest)")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt, exactly")
    p.add_argument("--ragged", action="store_true", help="prompt lengths from --prompt/2 up")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
    p.add_argument("--block-size", type=int, default=16, help="our paged cache's block")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the rows and the settings here")
    a = p.parse_args(argv)
    for flag in ("batch", "prompt", "new", "repeats", "block_size"):
        if getattr(a, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(a, flag)}: give 1 or more")
    a.device = bench_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    result = measure(a)
    print_table(result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
