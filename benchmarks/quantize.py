"""INT4 weight-only quantisation side by side: the model unquantised (fp32, bf16), our RTN
and AWQ (llm/inference/quantize.py, awq.py; group size 128) and torchao's INT4 weight-only
quantisation where it runs. Per row: the model's bytes and its block linears' bytes
(weights, scales, zero points, biases), the validation perplexity of a
trained run (with --run-dir; its own validation samples and tokenizer) and the time of the
block linears' matmuls for one decode step at batch 1 (every wq, wk, wv, wo, w1, (w3,) w2
once on a (1, K) input).

    python benchmarks/quantize.py --run-dir multirun/experiments/quantization/DATE/0
    python benchmarks/quantize.py --model llama-1b --layers 1     # decode-shaped matmuls only

Our INT4 rows come twice: "dequantise" (the reference path: unpack, dequantise, F.linear)
and "int4 kernel" (torch's tinygemm kernels on bf16 inputs: _weight_int4pack_mm_for_cpu on
CPU, _weight_int4pack_mm on CUDA), which the tests check against the reference; torchao's
row quantises the model in bf16 (its CUDA layout takes nothing else; on CPU its fp32 path,
the same kernel, is 8-40x slower than a dense fp32 matmul, its bf16 one is not).
--model builds a random-init model (vocabulary 4,096) and calibrates AWQ on random tokens:
its perplexity column is empty.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import median_ms
from llm.inference.evaluation import evaluation_data
from llm.inference.load import load_for_inference
from llm.inference.quantize import (
    QuantizedLinear,
    block_linears,
    quantize_model,
    token_loss,
    torchao_int4,
    weight_bytes,
)
from llm.models import build_model, materialize, model_args


def _decode_matmuls_ms(model: torch.nn.Module, dtype: torch.dtype, device) -> float:
    """Milliseconds for every block linear once on a (1, K) input of ``dtype``."""
    linears = list(_block_linears_as_they_are(model).values())
    inputs = {m: torch.randn(1, _in_features(m), device=device, dtype=dtype) for m in linears}

    def step() -> None:
        with torch.no_grad():
            for m in linears:
                m(inputs[m])

    return median_ms(step, warmup=3, min_run_time=0.5)


LINEAR_NAMES = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}


def _block_linears_as_they_are(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The block linears by name, whatever replaced them (ours, torchao's Linear)."""
    return {
        n: m
        for n, m in model.named_modules()
        if n.startswith("layers.") and n.rsplit(".", 1)[-1] in LINEAR_NAMES
    }


def _in_features(module: torch.nn.Module) -> int:
    return module.in_features if hasattr(module, "in_features") else module.weight.shape[1]


def _variants(base, calibration, device):
    """(name, dtype of its inputs, build) for every row; build returns the model or raises."""

    def ours(method: str, kernel: bool):
        def build():
            model = copy.deepcopy(base)
            quantize_model(model, method, calibration=calibration)
            if kernel:
                for m in model.modules():
                    if isinstance(m, QuantizedLinear):
                        m.use_kernel(torch.bfloat16)
            return model

        return build

    def torchao():
        model = copy.deepcopy(base).to(torch.bfloat16)
        torchao_int4(model)
        return model

    bf16 = torch.bfloat16
    return [
        ("fp32, unquantised", torch.float32, lambda: base),
        ("bf16, unquantised", torch.bfloat16, lambda: copy.deepcopy(base).to(torch.bfloat16)),
        ("RTN int4 g128, dequantise", torch.float32, ours("rtn", False)),
        ("RTN int4 g128, int4 kernel", bf16, ours("rtn", True)),
        ("AWQ int4 g128, dequantise", torch.float32, ours("awq", False)),
        ("AWQ int4 g128, int4 kernel", bf16, ours("awq", True)),
        ("torchao int4 g128", bf16, torchao),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="a training run's folder (its newest checkpoint)")
    p.add_argument("--model", default="gpt2-mini", help="without --run-dir: a random-init shape")
    p.add_argument("--layers", type=int, default=None, help="with --model: this many blocks")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    val = None
    if a.run_dir:
        loaded = load_for_inference(a.run_dir, None, device)
        data = OmegaConf.load(Path(a.run_dir) / ".hydra" / "config.yaml").data
        _digest, val, calibration = evaluation_data(OmegaConf.to_container(data))
        base, title = loaded.model, f"{a.run_dir} (step {loaded.step})"
    else:
        overrides = {"vocab_size": 4096, **({"n_layers": a.layers} if a.layers else {})}
        base = materialize(build_model(model_args(a.model, **overrides)), device, seed=0).eval()
        calibration = torch.randint(0, 4096, (16, 256), generator=torch.Generator().manual_seed(0))
        title = f"{a.model}, random init, {base.args.n_layers} blocks"
    print(f"{title}; {device}; {len(block_linears(base))} block linears, group size 128")
    print(f"{'variant':30} {'MiB':>8} {'linears MiB':>12} {'val ppl':>9} {'decode matmuls ms':>18}")
    for name, dtype, build in _variants(base, calibration, device):
        try:
            model = build()
        except Exception as exc:  # torchao's refusals differ by version and device
            print(f"{name:30} not run: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        ppl = f"{math.exp(token_loss(model, val)):9.4f}" if val is not None else f"{'-':>9}"
        ms = _decode_matmuls_ms(model, dtype, device)
        linears = sum(weight_bytes(m) for m in _block_linears_as_they_are(model).values())
        print(
            f"{name:30} {weight_bytes(model) / 2**20:8.2f} {linears / 2**20:12.2f} {ppl} {ms:18.3f}"
        )


if __name__ == "__main__":
    main()
