"""KV caches: the keys and values of every token a sequence has seen, per layer, so a decode
step computes one token's projections instead of the whole prefix's.

Two layouts behind one interface (``can_add``, ``add``, ``extend``, ``begin_step``, ``write``,
``attend``, ``advance``, ``free``):

- :class:`ContiguousKVCache`: one slab row per sequence, reserved at admission for the
  longest the sequence may grow (``row_len``): what systems before vLLM did.
- :class:`PagedKVCache`: vLLM's PagedAttention (Kwon et al., 2023): a pool of fixed-size
  blocks, a block table per sequence, blocks taken as tokens arrive and returned when the
  sequence ends, so a sequence holds at most one partly filled block.

Either way a token costs 2 (K and V) x n_layers x n_kv_heads x head_dim x element bytes
(:func:`kv_bytes_per_token`); grouped- and multi-query attention shrink it by n_heads /
n_kv_heads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llm.errors import ConfigError
from llm.inference.paged_attention import paged_decode_attention, sdpa
from llm.models import ModelArgs
from llm.parallel.tensor_parallel import local_kv_heads


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype, tp_size: int = 1) -> int:
    """2 x n_layers x n_kv_heads x head_dim x element size: one token's keys and values over
    every layer (per tensor-parallel rank: its share of the kv heads, or the one it keeps
    where tensor parallel replicates them)."""
    kv_heads = local_kv_heads(args.n_kv_heads, tp_size)
    return 2 * args.n_layers * kv_heads * args.head_dim * torch.finfo(dtype).bits // 8


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A new sequence's own causal attention: q (B, H, T, D), k, v (B, Hkv, T, D)."""
    return sdpa(q, k, v, causal=True)


class ContiguousKVCache:
    """``rows`` sequences of at most ``row_len`` tokens each, in one (L, 2, rows, Hkv,
    row_len, D) tensor; a sequence takes a whole row when admitted, used or not."""

    paged = False

    def __init__(
        self, args: ModelArgs, rows: int, row_len: int, dtype: torch.dtype, device
    ) -> None:
        self.args, self.row_len = args, row_len
        shape = (args.n_layers, 2, rows, args.n_kv_heads, row_len, args.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.row: dict[int, int] = {}  # sequence id -> its row
        self.lens: dict[int, int] = {}  # sequence id -> tokens written

    @property
    def capacity_tokens(self) -> int:
        return self.kv.shape[2] * self.row_len

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def reserved_tokens(self) -> int:
        return len(self.row) * self.row_len

    def used_tokens(self) -> int:
        return sum(self.lens.values())

    def can_add(self, n_tokens: int) -> bool:
        return bool(self.free_rows) and n_tokens <= self.row_len

    def add(self, seq: int, n_tokens: int) -> None:
        """Reserve a row for sequence ``seq`` and room for its first ``n_tokens``."""
        if not self.can_add(n_tokens):
            raise ConfigError(f"no free KV row for {n_tokens} tokens")
        self.row[seq] = self.free_rows.pop()
        self.lens[seq] = 0

    def extend(self, seq: int, n_tokens: int = 1) -> bool:
        """Room for ``n_tokens`` more tokens of ``seq``: a row has it up to row_len, and no
        other sequence's leaving can lengthen it."""
        if self.lens[seq] + n_tokens > self.row_len:
            raise ConfigError(
                f"sequence {seq} outgrew its KV row of {self.row_len} tokens; size the rows "
                "for prompt + max_new_tokens"
            )
        return True

    def free(self, seq: int) -> None:
        self.free_rows.append(self.row.pop(seq))
        del self.lens[seq]

    def begin_step(self, seqs: list[int], n_tokens: int, device) -> None:
        """Where this forward's ``n_tokens`` new tokens of each of ``seqs`` go, computed once
        for every layer: (row, position) per token, and each sequence's length after."""
        starts = [self.lens[s] for s in seqs]
        rows = [self.row[s] for s in seqs]
        self._rows = torch.tensor(rows, device=device).repeat_interleave(n_tokens)
        self._positions = torch.tensor(
            [p for start in starts for p in range(start, start + n_tokens)], device=device
        )
        self._row_of_seq = torch.tensor(rows, device=device)
        self._lens = torch.tensor([start + n_tokens for start in starts], device=device)
        self._longest = max(starts) + n_tokens

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Append k, v (B, Hkv, T, D) after each sequence's tokens so far (begin_step's)."""
        # (B, Hkv, T, D) -> (B * T, Hkv, D): one index_put per tensor.
        self.kv[layer, 0, self._rows, :, self._positions] = k.transpose(1, 2).flatten(0, 1)
        self.kv[layer, 1, self._rows, :, self._positions] = v.transpose(1, 2).flatten(0, 1)

    def advance(self, seqs: list[int], n_tokens: int) -> None:
        """After every layer wrote: the sequences hold ``n_tokens`` more tokens."""
        for seq in seqs:
            self.lens[seq] += n_tokens

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """One new token per sequence, already written: q (B, H, 1, D) over each sequence's
        tokens (its length including the new one) -> (B, H, 1, D)."""
        k = self.kv[layer, 0, self._row_of_seq, :, : self._longest]  # (B, Hkv, T, D)
        v = self.kv[layer, 1, self._row_of_seq, :, : self._longest]
        mask = torch.arange(self._longest, device=q.device) < self._lens[:, None]  # (B, T)
        return sdpa(q, k, v, mask[:, None, None, :])

    prefill_attention = staticmethod(_prefill_attention)


class BlockAllocator:
    """A free list of block ids; blocks are handed out one at a time and come back when a
    sequence ends (or is preempted)."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """A pool of ``n_blocks`` blocks of ``block_size`` tokens in one (L, 2, Hkv, n_blocks,
    block_size, D) tensor: per layer, K and V are (Hkv, n_blocks * block_size, D) when viewed
    flat, the physical layout FlexAttention's paged path reads. A sequence's block table
    lists its blocks in order; token p lives in block table[p // block_size] at offset
    p % block_size."""

    paged = True

    def __init__(
        self,
        args: ModelArgs,
        n_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        kernel: str = "gather",
    ) -> None:
        self.args, self.block_size, self.kernel = args, block_size, kernel
        shape = (args.n_layers, 2, args.n_kv_heads, n_blocks, block_size, args.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(n_blocks)
        self.tables: dict[int, list[int]] = {}  # sequence id -> its blocks, in order
        self.lens: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.n_blocks * self.block_size

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def reserved_tokens(self) -> int:
        return sum(len(t) for t in self.tables.values()) * self.block_size

    def used_tokens(self) -> int:
        return sum(self.lens.values())

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def can_add(self, n_tokens: int) -> bool:
        """Blocks for a prompt of ``n_tokens`` and a reserve left free for the running
        sequences to grow into (vLLM's watermark: 1% of the pool, at least one block) while
        others run; an empty cache needs no reserve."""
        reserve = max(1, self.allocator.n_blocks // 100) if self.tables else 0
        return self.blocks_for(n_tokens) + reserve <= self.allocator.free_blocks

    def add(self, seq: int, n_tokens: int) -> None:
        """A block table for ``seq`` with blocks for its first ``n_tokens`` (the prompt)."""
        if self.blocks_for(n_tokens) > self.allocator.free_blocks:
            raise ConfigError(
                f"no {self.blocks_for(n_tokens)} free KV blocks for {n_tokens} tokens"
            )
        self.tables[seq] = [self.allocator.take() for _ in range(self.blocks_for(n_tokens))]
        self.lens[seq] = 0

    def extend(self, seq: int, n_tokens: int = 1) -> bool:
        """Take the blocks ``n_tokens`` more tokens of ``seq`` need; False (nothing taken)
        when the pool has too few free."""
        need = self.blocks_for(self.lens[seq] + n_tokens) - len(self.tables[seq])
        if need > self.allocator.free_blocks:
            return False
        self.tables[seq].extend(self.allocator.take() for _ in range(max(need, 0)))
        return True

    def free(self, seq: int) -> None:
        self.allocator.give_back(self.tables.pop(seq))
        del self.lens[seq]

    def begin_step(self, seqs: list[int], n_tokens: int, device) -> None:
        """Where this forward's ``n_tokens`` new tokens of each of ``seqs`` go, computed once
        for every layer: (block, offset) per token, the block table (B, longest table)
        int32, short tables padded with block 0 (masked by length), and the lengths after."""
        blocks, offsets = [], []
        for seq in seqs:
            table = self.tables[seq]
            for p in range(self.lens[seq], self.lens[seq] + n_tokens):
                blocks.append(table[p // self.block_size])
                offsets.append(p % self.block_size)
        self._blocks = torch.tensor(blocks, device=device)
        self._offsets = torch.tensor(offsets, device=device)
        longest = max(len(self.tables[s]) for s in seqs)
        rows = [self.tables[s] + [0] * (longest - len(self.tables[s])) for s in seqs]
        self._table = torch.tensor(rows, dtype=torch.int32, device=device)
        lens = [self.lens[s] + n_tokens for s in seqs]
        self._lens = torch.tensor(lens, dtype=torch.int32, device=device)

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Append k, v (B, Hkv, T, D) after each sequence's tokens so far (begin_step's)."""
        # (B, Hkv, T, D) -> (Hkv, B * T, D): one index_put per tensor.
        self.kv[layer, 0, :, self._blocks, self._offsets] = k.transpose(0, 1).flatten(1, 2)
        self.kv[layer, 1, :, self._blocks, self._offsets] = v.transpose(0, 1).flatten(1, 2)

    def advance(self, seqs: list[int], n_tokens: int) -> None:
        for seq in seqs:
            self.lens[seq] += n_tokens

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """One new token per sequence, already written: q (B, H, 1, D) over its blocks."""
        out = paged_decode_attention(
            q[:, :, 0], self.kv[layer, 0], self.kv[layer, 1], self._table, self._lens, self.kernel
        )
        return out[:, :, None]  # (B, H, 1, D)

    prefill_attention = staticmethod(_prefill_attention)
