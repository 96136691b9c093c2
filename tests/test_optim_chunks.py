"""Our element-wise optimizers step in cache-sized batches of pieces on a CPU
(llm/optim/chunks.py): the batches cover every element once, and a step over tiny batches
gives the step over whole tensors (Lion and Sophia bit for bit; LAMB's norms summed over
pieces within a few ulps)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llm.optim import Lamb, Lion, SophiaG, chunks, param_groups


def test_pieces_cover_every_element_once_in_bounded_batches():
    tensors = [torch.zeros(5), torch.zeros(3, 4), torch.zeros(2), torch.zeros(4, 3).t()]
    counted = [0] * len(tensors)
    for (marks, twins), owners in chunks.pieces([tensors, tensors], limit=4):
        sizes = [t.numel() for t in marks]
        assert sum(sizes) <= 4 or len(marks) == 1  # only a lone piece may exceed the limit
        assert [t.shape for t in marks] == [t.shape for t in twins]
        for t, owner in zip(marks, owners, strict=True):
            t += 1  # writes through the view into the tensor it was cut from
            counted[owner] += t.numel()
    assert counted == [t.numel() for t in tensors]
    for t in tensors:
        assert torch.equal(t, torch.ones_like(t))  # every element exactly once
    # The transposed (non-contiguous) tensor stays whole: no flat view can cover it.
    batches = list(chunks.pieces([tensors], limit=4))
    assert any(not t.is_contiguous() for (ts,), _ in batches for t in ts)
    (whole,), owners = next(chunks.pieces([tensors], limit=None))
    assert owners == [0, 1, 2, 3] and whole == tensors


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(23, 17)
        self.norm = nn.LayerNorm(17)
        self.b = nn.Linear(17, 5, bias=False)


@pytest.mark.parametrize(
    "make, atol",
    [
        (lambda g: Lion(g, lr=1e-3), 0.0),
        (lambda g: SophiaG(g, lr=1e-3), 0.0),
        (lambda g: Lamb(g, lr=1e-2), 1e-7),
    ],
    ids=["lion", "sophia", "lamb"],
)
def test_tiny_batches_step_as_whole_tensors(monkeypatch, make, atol):
    torch.manual_seed(0)
    whole_model = _Model()
    pieces_model = copy.deepcopy(whole_model)
    whole = make(param_groups(whole_model, 0.1))
    in_pieces = make(param_groups(pieces_model, 0.1))
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in whole_model.parameters()]
        for model in (whole_model, pieces_model):
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.clone()
        monkeypatch.setattr(chunks, "CPU_BATCH_ELEMENTS", 1 << 30)
        whole.step()
        monkeypatch.setattr(chunks, "CPU_BATCH_ELEMENTS", 7)  # every matrix in many pieces
        in_pieces.step()
    for x, y in zip(whole_model.parameters(), pieces_model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)
