"""Document boundaries in a packed batch, in the form each backend needs.

With ``data.packing=true`` several documents share one sequence. ``attention.document_mask``
keeps each token inside its own document (causal inside it). The loader yields ``doc_ids``
(B, T): the document of each token, non-decreasing along a row. The model wraps them once
per forward in :class:`Documents`; each backend asks for its form, built on first use and
shared by every layer:

- eager, sdpa: a dense (B, 1, T, T) boolean mask (True: may attend);
- flex: a BlockMask, whose fully masked blocks the kernel skips;
- flash_attn: the batch flattened to (B*T) tokens cut into documents by ``cu_seqlens``;
- xformers: the same flattened batch cut by a BlockDiagonal(Causal)Mask of the lengths;
- triton: the ids themselves.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor


class Documents:
    def __init__(self, doc_ids: Tensor) -> None:
        self.ids = doc_ids  # (B, T) int, non-decreasing along T
        self._dense: dict[bool, Tensor] = {}
        self._block: dict[bool, object] = {}
        self._xformers: dict[bool, object] = {}

    def dense_mask(self, causal: bool) -> Tensor:
        """(B, 1, T, T) bool: query t may attend key s (same document, and s <= t if causal)."""
        if causal not in self._dense:
            ids = self.ids
            mask = ids.unsqueeze(2) == ids.unsqueeze(1)  # (B, T, T)
            if causal:
                t = ids.size(1)
                mask &= torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            self._dense[causal] = mask.unsqueeze(1)
        return self._dense[causal]

    def block_mask(self, causal: bool):
        """FlexAttention's BlockMask of the same mask (batch-dependent, shared by all heads)."""
        if causal not in self._block:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids

            def same_document(b, h, q, kv):
                keep = ids[b, q] == ids[b, kv]
                return keep & (q >= kv) if causal else keep

            b, t = ids.shape
            self._block[causal] = create_block_mask(same_document, b, None, t, t, device=ids.device)
        return self._block[causal]

    def xformers_mask(self, causal: bool):
        """xFormers' BlockDiagonalMask (BlockDiagonalCausalMask if causal) of the batch
        flattened to one row of B*T tokens: a block per document. Its lengths are read to
        the host once per forward (``from_seqlens`` takes a list)."""
        if causal not in self._xformers:
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask, BlockDiagonalMask

            cls = BlockDiagonalCausalMask if causal else BlockDiagonalMask
            lengths = self.varlen[0].diff().tolist()
            self._xformers[causal] = cls.from_seqlens(lengths, device=self.ids.device)
        return self._xformers[causal]

    @cached_property
    def varlen(self) -> tuple[Tensor, int]:
        """(cu_seqlens, max_seqlen) of the batch flattened to B*T tokens: document i is
        tokens cu_seqlens[i]:cu_seqlens[i+1]. cu_seqlens is int32 (flash-attn's type);
        max_seqlen is read to the host once per forward (flash-attn takes an int)."""
        # Row r's ids shifted above row r-1's, so a document never spans two rows.
        shift = torch.cat([self.ids.new_zeros(1), (self.ids[:, -1] + 1).cumsum(0)[:-1]])
        flat = (self.ids + shift.unsqueeze(1)).flatten()
        _, lengths = torch.unique_consecutive(flat, return_counts=True)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=self.ids.device)
        cu[1:] = lengths.cumsum(0)
        return cu, int(lengths.max())

    @cached_property
    def positions(self) -> Tensor:
        """(B, T) int64: each token's position inside its document (0 at each start)."""
        t = self.ids.size(1)
        idx = torch.arange(t, device=self.ids.device).expand_as(self.ids)
        starts = torch.ones_like(self.ids, dtype=torch.bool)
        starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        return idx - first
