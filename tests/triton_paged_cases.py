"""Runs the paged Triton decode kernel in Triton's interpreter on CPU, for
test_paged_attention.py, the way triton_interpreter_cases.py does for our FlashAttention:
TRITON_INTERPRET=1 must be set before triton is imported and must not reach the other tests,
so the test runs ``TRITON_INTERPRET=1 python tests/triton_paged_cases.py OUT.pt`` and compares
the saved outputs with the gather reference in-process.

The cases also build every kernel's inputs (``make_inputs``), the same in every process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]  # tokens of each sequence, the new one included
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    spare_blocks: int = 3  # pool blocks no sequence owns


# The kernel reads 64 keys a step: four blocks of 16, two of 32, half of one of 128. Lengths
# of 1, on a block edge (16, 64, 128) and ragged; blocks handed out in a shuffled order.
CASES = {
    "mha_bs16_D32": Case((1, 16, 37), heads=2, kv_heads=2, head_dim=32, block_size=16),
    "gqa_bs32_D64": Case((64, 5, 100), heads=4, kv_heads=2, head_dim=64, block_size=32),
    "mqa_bs16_D32": Case((33, 48, 1), heads=4, kv_heads=1, head_dim=32, block_size=16),
    "gqa_bs128_D16": Case((130, 7, 128), heads=8, kv_heads=2, head_dim=16, block_size=128),
}


def make_inputs(case: Case, seed: int = 0) -> dict:
    """q (B, H, D); each sequence's own keys and values, contiguous, (Hkv, len, D); and the
    same scattered into a pool (Hkv, n_blocks, block_size, D) through a shuffled block table
    (B, M) int32 padded with 0. ``live`` (n_blocks, block_size) marks the pool rows some
    sequence holds: everything else in the pool is random, so a kernel that reads it is off.
    """
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.kv_heads, case.head_dim
    blocks = [-(-n // bs) for n in case.lens]
    n_blocks = sum(blocks) + case.spare_blocks
    order = torch.randperm(n_blocks, generator=g).tolist()  # non-monotonic, block 0 in use
    k_pool = torch.randn(hkv, n_blocks, bs, d, generator=g)
    v_pool = torch.randn(hkv, n_blocks, bs, d, generator=g)
    live = torch.zeros(n_blocks, bs, dtype=torch.bool)
    table = torch.zeros(len(case.lens), max(blocks), dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(case.lens):
        mine, order = order[: blocks[b]], order[blocks[b] :]
        table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        k = torch.randn(hkv, n, d, generator=g)
        v = torch.randn(hkv, n, d, generator=g)
        for p in range(n):
            k_pool[:, mine[p // bs], p % bs] = k[:, p]
            v_pool[:, mine[p // bs], p % bs] = v[:, p]
            live[mine[p // bs], p % bs] = True
        keys.append(k)
        values.append(v)
    return {
        "q": torch.randn(len(case.lens), case.heads, d, generator=g),
        "k_pool": k_pool,
        "v_pool": v_pool,
        "block_table": table,
        "seq_lens": torch.tensor(case.lens, dtype=torch.int32),
        "keys": keys,
        "values": values,
        "live": live,
    }


def poisoned(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools with NaN in every row no sequence holds: one read of them (even multiplied
    by a zero weight) turns an output NaN."""
    dead = ~x["live"][None, :, :, None]
    return x["k_pool"].masked_fill(dead, float("nan")), x["v_pool"].masked_fill(dead, float("nan"))


def main(path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    from llm.inference.paged_attention import paged_decode_attention

    results = {}
    for name, case in CASES.items():
        x = make_inputs(case)
        k_pool, v_pool = poisoned(x)
        results[name] = paged_decode_attention(
            x["q"], k_pool, v_pool, x["block_table"], x["seq_lens"], kernel="triton"
        )
    torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
