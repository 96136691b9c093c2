"""8-bit AdamW on pieces of a parameter (llm/optim/adamw8bit.py) quantises exactly as
bitsandbytes does on the whole tensor in one process, when the pieces are cut at block
boundaries, and differs when they are not (the cut our ZeRO and FSDP avoid). One process:
bitsandbytes' step has no collective, so two pieces in one optimizer stand for two ranks.
bitsandbytes is imported inside the tests: the GPU pass collects this file where it is
absent (tests/test_gpu_pass.py)."""

from __future__ import annotations

import pytest
import torch

from llm.optim.adamw8bit import sharded_adamw8bit_class
from llm.optim.shard_layout import ParamLayout, ShardLayout

SHAPE, MIN_8BIT = (40, 64), 2048  # 2,560 elements: ten 256-element blocks


def _grads(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g) for _ in range(steps)]


def _whole(weights: torch.Tensor, steps: int):
    import bitsandbytes as bnb

    p = torch.nn.Parameter(weights.clone())
    opt = bnb.optim.AdamW8bit([p], lr=1e-2, min_8bit_size=MIN_8BIT)
    for grad in _grads(steps):
        p.grad = grad.clone()
        opt.step()
    return p.detach().flatten(), opt.state[p]


def _pieces(weights: torch.Tensor, steps: int, cut: int):
    flat = weights.flatten()
    pieces = [torch.nn.Parameter(flat[:cut].clone()), torch.nn.Parameter(flat[cut:].clone())]
    opt = sharded_adamw8bit_class()(pieces, lr=1e-2, min_8bit_size=MIN_8BIT)
    ranges = ((0, cut), (cut, flat.numel()))
    layout = ShardLayout([ParamLayout(SHAPE, "matrix", ranges)], {}, 0, None, torch.device("cpu"))
    layout.index = {id(p): 0 for p in pieces}
    opt.shard_layout = layout
    for grad in _grads(steps):
        for p, part in zip(pieces, (grad.flatten()[:cut], grad.flatten()[cut:]), strict=True):
            p.grad = part.clone()
        opt.step()
    return torch.cat([p.detach() for p in pieces]), [opt.state[p] for p in pieces]


def test_pieces_cut_at_a_block_boundary_quantise_as_the_whole_bit_for_bit():
    """The first piece (1,024 elements) is under min_8bit_size alone: it is 8-bit because
    its parameter is, as in one process."""
    weights = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    want_w, want = _whole(weights, 5)
    got_w, (a, b) = _pieces(weights, 5, cut=1024)
    assert a["state1"].dtype == torch.uint8
    assert torch.equal(got_w, want_w)
    for key in ("state1", "state2"):
        assert torch.equal(torch.cat([a[key], b[key]]), want[key].flatten()), key
    for key in ("absmax1", "absmax2"):
        assert torch.equal(torch.cat([a[key], b[key]]), want[key]), key


def test_a_cut_inside_a_block_quantises_otherwise():
    weights = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    want_w, _ = _whole(weights, 5)
    got_w, _ = _pieces(weights, 5, cut=1000)
    assert not torch.equal(got_w, want_w)


@pytest.mark.parametrize("cut", [1024, 1000])
def test_without_a_layout_a_small_piece_keeps_32_bit_moments(cut):
    """bitsandbytes' own rule, on a piece alone: what the layout corrects."""
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.zeros(cut))
    opt = bnb.optim.AdamW8bit([p], min_8bit_size=MIN_8BIT)
    p.grad = torch.ones(cut)
    opt.step()
    assert opt.state[p]["state1"].dtype == torch.float32
