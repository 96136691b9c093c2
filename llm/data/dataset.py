"""A tokenised split (one flat token stream plus document offsets) and its training samples.

packing=True: the stream is cut into overlapping blocks of seq_len + 1 tokens; block i is
tokens[i*T : i*T + T + 1], inputs are block[:-1], targets block[1:]. Every target counts.
packing=False: one sample per document, truncated to T + 1 tokens; inputs are padded with
eos and targets with IGNORE, so samples differ in how many targets they hold.

Packed batches carry ``doc_ids`` (B, T) int32: the document of each input token, counted
from 0 in each row (attention.document_mask keeps documents apart with them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

IGNORE = -100  # the target of a padded position; torch's cross_entropy ignore_index


class Batch(NamedTuple):
    input_ids: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, IGNORE where no loss is taken
    # (B, T) int32, non-decreasing along a row; None when samples are not packed
    doc_ids: torch.Tensor | None = None


class TokenDataset:
    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, eos_id: int) -> None:
        self.tokens = tokens  # (n_tokens,) uint16/uint32, usually a read-only memmap
        self.offsets = offsets  # (n_documents + 1,) int64; document i is tokens[off[i]:off[i+1]]
        self.eos_id = eos_id

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_documents(self) -> int:
        return len(self.offsets) - 1

    def num_samples(self, seq_len: int, packing: bool) -> int:
        if packing:
            return max(0, (self.n_tokens - 1) // seq_len)
        return self.n_documents

    def sample(self, i: int, seq_len: int, packing: bool) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (seq_len,) int64."""
        if packing:
            block = self.tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64)
            return block[:-1], block[1:]
        start = int(self.offsets[i])
        doc = self.tokens[start : min(int(self.offsets[i + 1]), start + seq_len + 1)].astype(
            np.int64
        )
        inputs = np.full(seq_len, self.eos_id, dtype=np.int64)
        targets = np.full(seq_len, IGNORE, dtype=np.int64)
        inputs[: len(doc) - 1] = doc[:-1]
        targets[: len(doc) - 1] = doc[1:]
        return inputs, targets

    def doc_ids(self, i: int, seq_len: int) -> np.ndarray:
        """(seq_len,) int32: the document of each input token of packed sample i, from 0."""
        stream = np.arange(i * seq_len, (i + 1) * seq_len)
        docs = np.searchsorted(self.offsets, stream, side="right") - 1
        return (docs - docs[0]).astype(np.int32)

    def batch(self, indices: Sequence[int], seq_len: int, packing: bool) -> Batch:
        pairs = [self.sample(int(i), seq_len, packing) for i in indices]
        inputs = torch.from_numpy(np.stack([p[0] for p in pairs]))
        targets = torch.from_numpy(np.stack([p[1] for p in pairs]))
        if not packing:
            return Batch(inputs, targets)
        docs = torch.from_numpy(np.stack([self.doc_ids(int(i), seq_len) for i in indices]))
        return Batch(inputs, targets, docs)
