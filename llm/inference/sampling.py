"""The next token from logits: greedy, or a draw after temperature, top-k and top-p (in that
order, as transformers' logits processors apply them).

Each sequence draws from its own generator, seeded from (seed, its index), so the tokens a
sequence samples do not depend on which others share its batch: paged and contiguous caches,
which batch differently, give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """(B, V) logits with the tokens outside top-k and outside the top-p nucleus at -inf.

    The nucleus is transformers' (TopPLogitsWarper), op for op: a token stays when the tokens
    more likely than it hold less than p, so one whose predecessors hold exactly p is dropped,
    and the most likely token always stays. The sort is ascending with torch's default (not
    stable) algorithm, the call transformers makes, so tokens tied at the edge of the nucleus
    are kept or dropped as there: which of them is kept follows the sort's order of ties,
    which torch does not define (on CPU past 16 tokens it is not index order)."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)
        # Mass of each token and every less likely one: at most 1 - p means the tokens
        # above it hold p or more.
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, params: SamplingParams, device, vocab_size: int | None = None) -> None:
        self.params = params
        self.device = device
        # The tokenizer's vocabulary: tensor parallel pads the model's past it, and those
        # untrained rows must never be drawn.
        self.vocab_size = vocab_size
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, seq: int) -> torch.Generator:
        if seq not in self._generators:
            g = torch.Generator(device=self.device)
            g.manual_seed(self.params.seed * 1_000_003 + seq)
            self._generators[seq] = g
        return self._generators[seq]

    def __call__(self, logits: Tensor, seqs: list[int]) -> Tensor:
        """logits (B, V) of sequences ``seqs`` -> token ids (B,)."""
        p = self.params
        logits = logits[..., : self.vocab_size]
        if p.temperature == 0:
            return logits.argmax(-1)
        logits = filter_logits(logits.float() / p.temperature, p.top_k, p.top_p)
        probs = logits.softmax(-1)
        return torch.cat(
            [
                torch.multinomial(probs[i], 1, generator=self._generator(s))
                for i, s in enumerate(seqs)
            ]
        )
