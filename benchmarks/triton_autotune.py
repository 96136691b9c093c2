"""Autotune our Triton FlashAttention kernels on this GPU and record the configurations that won.

For each (sequence length, head dim, causal) it runs one forward and backward of
``flash_attention_triton`` in bf16: the first call of a tuning key times every block-size /
warp configuration of each kernel and keeps the fastest. Shapes follow the FlashAttention-2
paper's benchmark: hidden size 2048 (heads = 2048 / head dim) and 16k tokens per batch
(batch = 16384 / T). Prints the winners as a markdown table (for docs/attention.md) and
writes them, with the GPU's name and the versions, to --out.

    python benchmarks/triton_autotune.py                    # T 512..16k, D 64 and 128, causal and not
    python benchmarks/triton_autotune.py --seq-lens 2048 --head-dims 128 --documents
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llm.attention.triton_flash import flash_attention_triton, triton_available
from llm.attention.triton_tuning import autotuned_configs, gpu_name, markdown_table

REPO = Path(__file__).resolve().parent.parent


def tune_one(seq_len: int, head_dim: int, causal: bool, documents: bool, dtype) -> None:
    batch, heads = max(1, 16384 // seq_len), 2048 // head_dim
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    doc_ids = None
    if documents:  # four documents of uneven length per row
        cuts = torch.tensor([seq_len // 8, seq_len // 3, seq_len // 2], device="cuda")
        doc_ids = torch.bucketize(torch.arange(seq_len, device="cuda"), cuts).expand(batch, -1)
    out = flash_attention_triton(q, k, v, causal=causal, doc_ids=doc_ids)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--documents", action="store_true", help="also tune with document masks")
    p.add_argument("--out", default="outputs/triton_autotune.json", help="JSON ('' for none)")
    a = p.parse_args(argv)
    if reason := triton_available():
        raise SystemExit(reason)
    dtype = getattr(torch, a.dtype)
    for seq_len in map(int, a.seq_lens.split(",")):
        for head_dim in map(int, a.head_dims.split(",")):
            for causal in (False, True):
                for documents in (False, True) if a.documents else (False,):
                    tune_one(seq_len, head_dim, causal, documents, dtype)
                    print(f"tuned T={seq_len} D={head_dim} causal={causal} docs={documents}")
    rows = autotuned_configs()
    print(f"\nAutotuned on {gpu_name()} (triton {_triton_version()}, torch {torch.__version__}):\n")
    print(markdown_table(rows))
    if a.out:
        path = REPO / a.out
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": gpu_name(), "triton": _triton_version(), "torch": torch.__version__}
        path.write_text(json.dumps({**meta, "configs": rows}, indent=1) + "\n")
        print(f"\nwrote {path}")


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
