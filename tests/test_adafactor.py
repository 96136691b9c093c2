"""Our Adafactor (llm/optim/adafactor.py) against torch.optim.Adafactor and transformers'
Adafactor to rounding, step by step in one process."""

from __future__ import annotations

import pytest
import torch
from transformers.optimization import Adafactor as HFAdafactor

from llm.optim.adafactor import Adafactor

SHAPES = [(7, 5), (3, 4, 6), (5,)]  # a matrix, a stack of matrices (factored over the
# last two dims) and a vector (a full second moment)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _run(make, steps: int = 12) -> list[list[torch.Tensor]]:
    """Each step's parameters, with gradients that differ per step and per element."""
    params = _params()
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g)
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("lr", [1e-2, 0.3])
def test_ours_equals_torch_to_rounding(lr):
    """lr 0.3: the relative step is 1/sqrt(t) until t > 11, then lr; weight decay on the
    matrices only, as our param groups set it. Every scalar is torch's to the bit; the last
    multiply-add differs by an fp32 rounding: torch's takes its factor as a host number (a
    fused multiply-add), ours as a device tensor (no host read per parameter)."""

    def groups(params):
        return [
            {"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0},
        ]

    ours = _run(lambda ps: Adafactor(groups(ps), lr=lr, eps=(None, 1e-3), d=1.0))
    theirs = _run(
        lambda ps: torch.optim.Adafactor(groups(ps), lr=lr, eps=(None, 1e-3), d=1.0, foreach=False)
    )
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"step {step}")


def test_ours_matches_transformers_to_rounding():
    """transformers' relative step is min(1e-2, 1/sqrt(t)) times max(1e-3, RMS(w)), as ours
    at lr 1e-2; its eps1 (1e-30) is added to g^2 where ours clamps V at eps1^2, which
    differ only for a near-zero second moment. No weight decay: transformers scales it by
    the relative step, torch (and ours) by lr."""
    ours = _run(lambda ps: Adafactor(ps, lr=1e-2))
    hf = _run(lambda ps: HFAdafactor(ps, lr=None, relative_step=True, scale_parameter=True))
    for a, b in zip(ours, hf, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    moved = [(x - y).abs().max().item() for x, y in zip(ours[-1], _params(), strict=True)]
    assert min(moved) > 1e-3  # the comparison is of parameters that moved


def test_state_is_factored():
    params = _params()
    opt = Adafactor(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[params[1]]
    assert state["row_var"].shape == (3, 4, 1) and state["col_var"].shape == (3, 1, 6)
    assert opt.state[params[2]]["variance"].shape == (5,)


@pytest.mark.parametrize("kwargs", [{"lr": 0.0}, {"beta2_decay": 0.5}, {"d": 0.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="Adafactor needs"):
        Adafactor(_params(), **kwargs)
