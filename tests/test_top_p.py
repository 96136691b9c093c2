"""filter_logits' top-p nucleus against transformers' TopPLogitsWarper (and TopKLogitsWarper
before it, as generate chains them), on the same logits: the outputs are equal exactly,
-inf where a token is dropped, on random logits and on ties, in fp32 and bf16.

At exactly p transformers drops the token (its predecessors already hold p); ties at the
nucleus' edge are broken by the order its ascending, default (unstable) torch.sort gives.
"""

import pytest
import torch

from llm.inference.sampling import filter_logits


def _warped(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    if top_k > 0:
        logits = TopKLogitsWarper(top_k)(None, logits)
    return TopPLogitsWarper(top_p)(None, logits)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), (ours.isinf().sum(-1), theirs.isinf().sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [0, 20])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_random_logits_match_transformers(dtype, top_k, top_p):
    g = torch.Generator().manual_seed(int(top_p * 1000) + top_k)
    logits = (torch.randn(8, 1000, generator=g) * 3).to(dtype)
    ours = filter_logits(logits, top_k, top_p)
    _assert_same(ours, _warped(logits, top_k, top_p))
    assert (ours.isfinite().sum(-1) >= 1).all()  # the most likely token always stays


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_tied_tokens_at_p_half_keep_one(dtype):
    """Each holds exactly 0.5: the second in sorted order already has p before it."""
    for vocab in (2, 5):
        logits = torch.full((1, vocab), -30.0, dtype=dtype)
        logits[0, :2] = 4.0
        ours = filter_logits(logits, 0, 0.5)
        _assert_same(ours, _warped(logits, 0, 0.5))
        assert ours.isfinite().sum().item() == 1


def test_a_nucleus_holding_exactly_p_ends_there():
    """Four equal tokens at p = 0.5: two hold exactly p, so the third is dropped."""
    logits = torch.zeros(1, 4)
    ours = filter_logits(logits, 0, 0.5)
    _assert_same(ours, _warped(logits, 0, 0.5))
    assert ours.isfinite().sum().item() == 2


@pytest.mark.parametrize("vocab", [16, 17, 1000, 4096])
@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.75])
def test_tied_bf16_logits_match_transformers(vocab, top_p):
    """bf16 rounding ties many logits; a handful of values with many copies each puts ties at
    the nucleus' edge, where the sort's order of ties decides (torch's CPU sort is not
    stable past 16 elements, so index order would not do)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randint(0, 6, (16, vocab), generator=g) * 0.5).to(torch.bfloat16)
    for x in (logits, logits.float()):  # bf16 scores, and bf16 logits cast up as generate does
        ours = filter_logits(x, 0, top_p)
        _assert_same(ours, _warped(x, 0, top_p))
