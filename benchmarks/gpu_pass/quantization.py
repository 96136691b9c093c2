"""INT4 weight-only (group size 128) against bf16 at decode: single matmuls at llama-1b's
shapes (wq/wo 2048 x 2048, w1/w3 2048 -> 8192, w2 8192 -> 2048) at batch 1 and 16, and one
decode step (KV cache of a 128-token prompt) of a 2-layer llama-1b, tokens/s. INT4 rows: ours
(llm/inference/quantize.py: RTN, and AWQ with its input divisors, through torch's
``_weight_int4pack_mm``) and torchao's ``Int4WeightOnlyConfig`` (tinygemm layout). The
embedding and the output head stay bf16 (AWQ's choice), so the 2-layer model's step keeps
the head's 525 MB read: the matmul rows show the blocks' own speed-up. (The AWQ paper's
TinyChat reports 3.2-3.3x over Hugging Face's FP16 on average, end to end: its own kernels
and fused layers, not this comparison.)

The dry run: CPU, fp32, tiny shapes; torch's CPU int4 kernel and torchao's prototype CPU
config.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu_pass.common import Result, device
from benchmarks.timing import median_ms
from llm.inference.forward import decode, prefill
from llm.inference.kv_cache import ContiguousKVCache
from llm.inference.quantize import QuantizedLinear, quantize_model, torchao_int4
from llm.models import build_model, materialize, model_args

GPU = {
    "shapes": [(2048, 2048), (2048, 8192), (8192, 2048)],  # (in, out)
    "batches": (1, 16),
    "model": {"n_layers": 2},
    "prompt": 128,
    "dtype": torch.bfloat16,
    "min_time": 0.3,
}
DRY = {
    "shapes": [(128, 256), (256, 128)],
    "batches": (1, 4),
    "model": {"n_layers": 2, "d_model": 128, "d_ff": 256, "n_heads": 4, "n_kv_heads": 2,
              "vocab_size": 512},
    "prompt": 16,
    "dtype": torch.float32,
    "min_time": 0.02,
}  # fmt: skip


def _kernel(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            m.use_kernel(dtype)
    return module


def _matmul_rows(s: dict, dev: torch.device, notes: list[str]) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    timing = {"warmup": 3, "min_run_time": s["min_time"]}
    for k, n in s["shapes"]:
        linear = nn.Linear(k, n, bias=False)
        nn.init.normal_(linear.weight, std=k**-0.5, generator=g)
        linear = linear.to(dev, s["dtype"])
        ours = _kernel(QuantizedLinear.from_linear(linear, 128), s["dtype"])
        try:
            theirs = torchao_linear(copy.deepcopy(linear))
        except Exception as exc:  # torchao refuses devices and dtypes it has no layout for
            theirs = None
            notes.append(f"torchao {k}x{n}: not run: {type(exc).__name__}: {exc}"[:200])
        for b in s["batches"]:
            x = torch.randn(b, k, device=dev, dtype=s["dtype"])
            with torch.no_grad():
                base = median_ms(partial(F.linear, x, linear.weight), **timing)
                mine = median_ms(partial(ours, x), **timing)
                tao = None if theirs is None else median_ms(partial(theirs, x), **timing)
            rows.append({
                "what": f"matmul {k}->{n}", "batch": b, "dense_ms": base, "ours_ms": mine,
                "torchao_ms": tao, "ours_speedup": base / mine,
                "torchao_speedup": None if tao is None else base / tao,
            })  # fmt: skip
    return rows


def torchao_linear(linear: nn.Linear) -> nn.Module:
    """torchao's INT4 weight-only quantisation of one linear."""
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    if linear.weight.is_cuda:
        quantize_(
            linear, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        )
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        quantize_(linear, PrototypeInt4WeightOnlyConfig(group_size=128))
    return linear


def _decode_ms(model: nn.Module, batch: int, s: dict, dev: torch.device) -> float:
    """One decode step of ``batch`` sequences after a prompt of s["prompt"] tokens."""
    args = model.args
    cache = ContiguousKVCache(args, batch, s["prompt"] + 1, s["dtype"], dev)
    seqs = list(range(batch))
    for q in seqs:
        cache.add(q, s["prompt"])
    prompt = torch.randint(0, args.vocab_size, (batch, s["prompt"]), device=dev)
    prefill(model, prompt, cache, seqs)
    tokens = torch.randint(0, args.vocab_size, (batch,), device=dev)

    def step() -> None:
        decode(model, tokens, cache, seqs)
        for q in seqs:  # the same position every call: the row holds prompt + 1 tokens
            cache.lens[q] -= 1

    return median_ms(step, warmup=3, min_run_time=s["min_time"])


def _decode_rows(s: dict, dev: torch.device, notes: list[str]) -> list[dict]:
    args = model_args("llama-1b", max_seq_len=s["prompt"] + 1, **s["model"])
    base = materialize(build_model(args), dev, seed=0).to(s["dtype"]).eval()
    calibration = torch.randint(0, args.vocab_size, (8, s["prompt"]), device=dev)
    variants = {"dense": base}
    rtn = copy.deepcopy(base)
    quantize_model(rtn, "rtn")
    variants["ours_rtn"] = _kernel(rtn, s["dtype"])
    awq = copy.deepcopy(base)
    quantize_model(awq, "awq", calibration=calibration)
    variants["ours_awq"] = _kernel(awq, s["dtype"])
    try:
        tao = copy.deepcopy(base)
        torchao_int4(tao)
        variants["torchao"] = tao
    except Exception as exc:
        notes.append(f"torchao decode: not run: {type(exc).__name__}: {exc}"[:200])
    rows = []
    for b in s["batches"]:
        ms = {name: _decode_ms(m, b, s, dev) for name, m in variants.items()}
        rows.append({
            "what": f"decode step, llama-1b x {args.n_layers} layers", "batch": b,
            "dense_ms": ms["dense"], "ours_ms": ms["ours_rtn"], "ours_awq_ms": ms["ours_awq"],
            "torchao_ms": ms.get("torchao"), "ours_speedup": ms["dense"] / ms["ours_rtn"],
            "torchao_speedup": ms["dense"] / ms["torchao"] if "torchao" in ms else None,
            "dense_tokens_per_s": b / ms["dense"] * 1e3,
            "ours_tokens_per_s": b / ms["ours_rtn"] * 1e3,
        })  # fmt: skip
    return rows


def run(dry: bool) -> Result:
    s, dev = (DRY if dry else GPU), device(dry)
    notes: list[str] = []
    rows = _matmul_rows(s, dev, notes) + _decode_rows(s, dev, notes)
    dtype = str(s["dtype"]).removeprefix("torch.")
    return Result(
        title="INT4 weight-only (g128): ours and torchao against dense, decode shapes",
        shapes=f"{dtype}; matmuls (in->out) at batch {s['batches']}; decode step after a "
        f"{s['prompt']}-token prompt; dense = {dtype} F.linear / the unquantised model",
        columns=["what", "batch", "dense_ms", "ours_ms", "ours_awq_ms", "torchao_ms",
                 "ours_speedup", "torchao_speedup", "dense_tokens_per_s", "ours_tokens_per_s"],
        rows=rows,
        notes=notes,
    )  # fmt: skip
