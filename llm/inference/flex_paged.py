"""Decode attention through a block table with torch's FlexAttention: the pool is the
physical K/V, one (1, Hkv, n_blocks * block_size, D) sequence that every query attends into,
and a mask says which of its positions belong to which sequence.

Physical position j is in block j // block_size at row j % block_size. Sequence b may read
it only when that block is in b's table, at logical index i, and i * block_size + row <
seq_lens[b]. The mask_mod looks i up in a (B, n_blocks) map from physical block to logical
index (-1: not b's), the block table inverted. The BlockMask lists, per sequence, its whole
blocks (flex reads them without calling mask_mod) and the partly filled last one (mask_mod
masks its tail); every other block of the pool is skipped, so a step reads only the
sequence's own blocks, in the order of its table. Its KV block size is the cache's
block_size; its Q block is flex's 128 (one query row here).

Compiled with static shapes (``dynamic=False``): torch takes its split-KV decoding kernel
only for a batch size known at compile time, so each batch size (and dtype, and pool size)
compiles once: seconds on a GPU, about 20 s on CPU. Past dynamo's recompile limit (8 per
function) torch runs flex's unfused reference, scores over the whole pool; a change that
fails a guard recompiles too (torch.set_num_threads, which torch.utils.benchmark's Timer
calls). The block table's width never enters the compiled call (the block lists are padded
to n_blocks), so a growing sequence does not recompile. The decoding kernel's tile is at
most one KV block (16 keys at block_size 16), and it needs n_heads / n_kv_heads to be a power
of two: other group sizes take torch's general kernel, whose tiles of 64 keys or more must
divide the block size, so they are refused on CUDA. This is our own mask: torch's private
``torch.nn.attention.experimental._paged_attention.PagedAttention`` keeps its own page table
and allocator, which our cache already has.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from llm.errors import ConfigError

Q_BLOCK = 128  # flex's default query block; decode has one query row per sequence


def _attend(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


@cache
def compiled_paged_flex():
    """Its own function under compile, so its compiled shapes are not counted against
    training's ``llm.attention.flex.compiled_flex`` (dynamo caches per code object)."""
    return torch.compile(_attend, dynamic=False)


def paged_block_mask(
    block_table: Tensor, seq_lens: Tensor, n_blocks: int, block_size: int
) -> BlockMask:
    """The BlockMask of one decode step: q (B, H, 1, D) against the pool viewed flat,
    (1, Hkv, n_blocks * block_size, D). block_table (B, M) int32, seq_lens (B,) >= 1."""
    b, m = block_table.shape
    dev = block_table.device
    table = block_table.long()
    logical = torch.arange(m, device=dev)
    owned = logical[None, :] * block_size < seq_lens[:, None]  # (B, M): not padding
    # Physical block -> its logical index in b's table; padding goes to a spare column, so a
    # padded 0 never overwrites block 0 when the sequence really holds it.
    to_logical = torch.full((b, n_blocks + 1), -1, dtype=torch.int32, device=dev)
    to_logical.scatter_(1, torch.where(owned, table, n_blocks), logical.int().expand(b, m))
    to_logical = to_logical[:, :n_blocks]
    lens = seq_lens.to(torch.int32)

    def mask_mod(bi, h, q_idx, kv_idx):
        index = to_logical[bi, kv_idx // block_size]
        return (index >= 0) & (index * block_size + kv_idx % block_size < lens[bi])

    whole = lens // block_size  # (B,) blocks every row of which is in the sequence
    full_indices = torch.zeros(b, 1, 1, n_blocks, dtype=torch.int32, device=dev)
    full_indices[:, 0, 0, :m] = block_table
    last = torch.gather(table, 1, whole.clamp(max=m - 1).long()[:, None])  # (B, 1)
    partial_indices = torch.zeros_like(full_indices)
    partial_indices[:, 0, 0, 0] = last[:, 0].to(torch.int32)
    has_partial = (lens % block_size != 0).to(torch.int32)
    return BlockMask.from_kv_blocks(
        has_partial[:, None, None],
        partial_indices,
        whole[:, None, None],
        full_indices,
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, n_blocks * block_size),
        compute_q_blocks=False,  # the query-major lists only backward reads
    )


def flex_paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    compiled: bool = True,
) -> Tensor:
    """Shapes as in ``paged_attention``; returns (B, H, D) in q's dtype. ``compiled=False``
    runs flex's unfused reference (scores over the whole pool: tests only)."""
    (_, h, d), (hkv, n_blocks, bs, dk) = q.shape, k_pool.shape
    if d != dk or h % hkv != 0:
        raise ConfigError(
            f"paged flex attention: q {tuple(q.shape)} and pool {tuple(k_pool.shape)} must share "
            "D, and the pool's kv head count must divide q's head count"
        )
    if q.device.type not in ("cuda", "cpu"):
        raise ConfigError(f"paged flex attention runs on CUDA or CPU, not {q.device}; use gather")
    group = h // hkv
    if q.device.type == "cuda" and group & (group - 1):
        raise ConfigError(
            f"paged flex attention on CUDA needs n_heads / n_kv_heads to be a power of two (got "
            f"{h} / {hkv}): torch's other flex kernel cannot read {bs}-token blocks; use triton"
        )
    block_mask = paged_block_mask(block_table, seq_lens, n_blocks, bs)
    k = k_pool.reshape(1, hkv, n_blocks * bs, d)  # a view: the pool's blocks are contiguous
    v = v_pool.reshape(1, hkv, n_blocks * bs, d)
    attend = compiled_paged_flex() if compiled else _attend
    return attend(q[:, :, None], k, v, block_mask)[:, :, 0]
