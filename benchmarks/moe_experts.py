"""``python -m benchmarks.moe_experts``: the experts of one MoE layer, forward + backward,
through torch's grouped matmul against the loop over experts (llm/models/moe.py), at
Mixtral-8x7B's and DeepSeekMoE-16B's expert shapes, with the two kernels' largest output
difference. Needs a CUDA device of compute capability 9.0 or above (bf16); on CPU it runs a
small shape in fp32 to check the code path."""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.timing import mean_cuda_ms
from llm.models.moe import Experts

SHAPES = {  # name: (d_model, d_expert, routed experts, top_k)
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-moe-16b": (2048, 1408, 64, 6),
}


def measure(name, d, f, e, k, tokens, device, dtype, repeats) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens * k, d, device=device, dtype=dtype, generator=g)
    # Routed rows split unevenly, as a router's are: a skewed draw over experts.
    picks = torch.multinomial(torch.linspace(1, 3, e, device=device), tokens * k, True, generator=g)
    counts = torch.bincount(picks, minlength=e)
    row = {"shape": name, "tokens": tokens, "top_k": k, "experts": e}
    outputs = {}
    weights = Experts(e, d, f, "loop").to(device=device, dtype=dtype)
    with torch.no_grad():
        for w in weights.parameters():
            w.normal_(0, 0.02, generator=g)
    for kernel in ("loop", "grouped"):
        experts = Experts(e, d, f, kernel).to(device=device, dtype=dtype)
        experts.load_state_dict(weights.state_dict())
        xi = x.clone().requires_grad_(True)

        def step(experts=experts, xi=xi):
            experts(xi, counts).sum().backward()

        row[f"{kernel}_ms"] = mean_cuda_ms(step, device, repeats)
        with torch.no_grad():
            outputs[kernel] = experts(x, counts).float()
    row["max_abs_diff"] = (outputs["loop"] - outputs["grouped"]).abs().max().item()
    row["scale"] = outputs["loop"].abs().max().item()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SHAPES if cuda else {"cpu-check": (64, 96, 8, 2)}
    tokens = a.tokens if cuda else 64
    rows = [measure(n, *s, tokens, device, dtype, a.repeats) for n, s in shapes.items()]
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"experts forward + backward, {tokens} tokens, {dtype}, {where}, torch {torch.__version__}"
    )
    print("| shape | experts | top_k | loop ms | grouped ms | speed-up | max |diff| / max |out| |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["loop_ms"] / r["grouped_ms"]
        print(
            f"| {r['shape']} | {r['experts']} | {r['top_k']} | {r['loop_ms']:.2f} | "
            f"{r['grouped_ms']:.2f} | {ratio:.2f}x | {r['max_abs_diff']:.2e} / {r['scale']:.2e} |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": where, "torch": torch.__version__, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
