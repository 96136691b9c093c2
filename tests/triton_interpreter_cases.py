"""Runs our Triton kernel in Triton's interpreter on CPU, for test_triton_flash.py.

Triton decides compiled or interpreted when it is imported (its own ``tl`` helpers are
jitted then), so TRITON_INTERPRET=1 must be set before the import, and must not reach the
other tests of the pytest process (torch.compile on a GPU would interpret its kernels).
The test therefore runs this file in a subprocess:
``TRITON_INTERPRET=1 python tests/triton_interpreter_cases.py OUT.pt``; it saves our output
and the three gradients for every case, and the test compares them with eager in-process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    causal: bool
    docs: tuple[tuple[int, ...], ...] | None = None  # document lengths per batch row
    strided: bool = False  # q, k, v as (B, T, H, D).transpose(1, 2) views, as models make them
    # (input, first token, end token) set to NaN: a block the kernel should skip but reads
    # turns what it touches into NaN (a mask multiplies by 0, and 0 * NaN is NaN).
    poison: tuple[tuple[str, int, int], ...] = ()
    # (output, first token, end token) that must match the clean reference; None: everything.
    checked: tuple[tuple[str, int, int], ...] | None = None


# Interpreter blocks are BLOCK_M=32, BLOCK_N=16 (dK/dV: 16 query rows past 32 keys), so
# T=100 leaves ragged tails in every kernel and T=64 ends on block edges.
CASES = {
    "one_token_causal": Case(1, 2, 2, 1, 32, causal=True),
    "mha_full_T17_D64": Case(1, 2, 2, 17, 64, causal=False),
    "mha_causal_T64_D32": Case(2, 2, 2, 64, 32, causal=True),
    "gqa_causal_T100_D64_strided": Case(1, 4, 2, 100, 64, causal=True, strided=True),
    "mqa_full_T100_D32": Case(1, 4, 1, 100, 32, causal=False),
    "docs_causal_T100_D32": Case(2, 2, 2, 100, 32, causal=True, docs=((7, 50, 43), (61, 39))),
    "docs_full_gqa_T64_D32": Case(1, 4, 2, 64, 32, causal=False, docs=((5, 30, 29),)),
    "d128_causal_T40": Case(1, 2, 1, 40, 128, causal=True),
    # Documents on block edges: no block of document 0 may be read for document 1 (any kernel).
    "skips_other_documents": Case(
        1, 2, 2, 64, 32, causal=True, docs=((32, 32),),
        poison=(("v", 0, 32), ("grad_out", 0, 32)),
        checked=(("out", 32, 64), ("dq", 32, 64), ("dk", 32, 64), ("dv", 32, 64)),
    ),
    # No key block above the diagonal is read for a query block (forward, dQ) ...
    "skips_future_keys": Case(
        1, 2, 2, 64, 32, causal=True, poison=(("v", 32, 64),), checked=(("out", 0, 32), ("dq", 0, 32))
    ),
    # ... and no query block before a key block (dK, dV).
    "skips_past_queries": Case(
        1, 2, 2, 64, 32, causal=True, poison=(("q", 0, 32),), checked=(("dk", 32, 64), ("dv", 32, 64))
    ),
}  # fmt: skip


def make_inputs(case: Case, *, poisoned: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """q, k, v, the output gradient and doc_ids for a case, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    b, t, d = case.batch, case.seq_len, case.head_dim

    def heads(n: int) -> torch.Tensor:
        if case.strided:
            return torch.randn(b, t, n, d, generator=g).transpose(1, 2)
        return torch.randn(b, n, t, d, generator=g)

    q, k, v = heads(case.heads), heads(case.kv_heads), heads(case.kv_heads)
    grad_out = torch.randn(b, case.heads, t, d, generator=g)
    doc_ids = None
    if case.docs is not None:
        ids = [torch.arange(len(row)).repeat_interleave(torch.tensor(row)) for row in case.docs]
        doc_ids = torch.stack(ids) * 3 + 1  # ids need not start at 0 or be consecutive
    x = {"q": q, "k": k, "v": v, "grad_out": grad_out, "doc_ids": doc_ids}
    for name, start, end in case.poison if poisoned else ():
        x[name][:, :, start:end] = float("nan")
    return x


def run_case(case: Case) -> dict[str, torch.Tensor]:
    from llm.attention.triton_flash import flash_attention_triton

    x = make_inputs(case, poisoned=True)
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = flash_attention_triton(q, k, v, causal=case.causal, doc_ids=x["doc_ids"])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), x["grad_out"])
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def main(path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    from llm.attention.triton_tuning import autotuned_configs

    results = {name: run_case(case) for name, case in CASES.items()}
    torch.save({"cases": results, "autotuned": autotuned_configs()}, path)


if __name__ == "__main__":
    main(sys.argv[1])
