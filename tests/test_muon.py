"""Our Muon (llm/optim/muon.py) against torch.optim.Muon bit for bit in one process; its
Newton-Schulz FLOPs against torch's FLOP counter; the owner assignment and the shard
exchanges it builds on (llm/optim/shard_layout.py) in one process. Across ranks:
tests/test_optim_strategies.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llm.optim.muon import Muon, newton_schulz, newton_schulz_flops
from llm.optim.shard_layout import OwnerExchange, ParamLayout, ShardLayout, balanced_owners

SHAPES = [(8, 12), (12, 8), (6, 6)]  # wide, tall (orthogonalised transposed), square


def _run(make, steps: int = 6) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = make(params)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_ours_equals_torch_bit_for_bit(adjust, nesterov):
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": adjust}
    ours = _run(lambda ps: Muon(ps, **kwargs))
    theirs = _run(lambda ps: torch.optim.Muon(ps, **kwargs))
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), step


def test_fp32_newton_schulz_differs_from_bf16_and_stays_orthogonal():
    """ns_dtype float32 is a different computation (not bf16's), and its result is as close
    to semi-orthogonal as the quintic gets: singular values within torch's (0.5, 1.5)."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    fp32, bf16 = newton_schulz(x, 5, torch.float32), newton_schulz(x, 5, torch.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert not torch.equal(fp32, bf16.float())
    s = torch.linalg.svdvals(fp32)
    assert s.min() > 0.5 and s.max() < 1.5


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (64, 256)])
def test_newton_schulz_flops_match_torchs_counter(shape):
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(shape), 5, torch.float32)
    assert counter.get_total_flops() == newton_schulz_flops(shape, 5)


def test_owners_balance_flops_largest_first():
    costs = {0: 10.0, 1: 7.0, 2: 6.0, 3: 5.0, 4: 1.0}
    owners = balanced_owners(costs, 2)
    assert owners == {0: 0, 1: 1, 2: 1, 3: 0, 4: 1}  # loads 15 and 14
    assert balanced_owners(costs, 2) == owners  # the same on every rank


def _layout(world_ranges, rank=0):
    params = [ParamLayout((4, 6), "hidden", r) for r in world_ranges]
    return ShardLayout(params, {}, rank, None, torch.device("cpu"))


def test_one_rank_exchanges_return_whole_matrices_and_pieces():
    """With one rank holding every element, gather and the owner round trip are identities,
    and each counts its payload in the comm-counter convention."""
    counted = []
    layout = _layout([((0, 24),), ((0, 24),)])
    layout.count = lambda kind, t: counted.append((kind, t.numel()))
    pieces = {0: torch.arange(24.0), 1: -torch.arange(24.0)}
    whole = layout.gather_whole([0, 1], pieces)
    assert all(torch.equal(whole[i], pieces[i]) for i in pieces)
    exchange = OwnerExchange(layout, [0, 1], {0: 0, 1: 0})
    back = exchange.from_owners(exchange.to_owners(pieces))
    assert all(torch.equal(back[i], pieces[i]) for i in pieces)
    assert counted == [("optim.all_gather", 48), ("optim.all_to_all", 48), ("optim.all_to_all", 48)]


@pytest.mark.slow
def test_counted_comm_and_flops_equal_the_layouts_formula(tmp_path):
    """benchmarks/muon_modes.py on 2 gloo ranks: on every rank, the bytes the strategy's
    counter measured equal muon_costs' formula, and the FLOPs torch's counter measured in the
    optimizer step equal Newton-Schulz's formula, for both modes under zero2 and fsdp."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    raw = tmp_path / "muon_modes.json"
    command = [sys.executable, "-m", "benchmarks.muon_modes", "--model", "llama-tiny"]
    command += ["--world", "2", "--steps", "1", "--json", str(raw)]
    subprocess.run(command, cwd=Path(__file__).resolve().parents[1], check=True)
    rows = json.loads(raw.read_text())
    assert len(rows) == 2 * 2 * 2  # strategies x modes x ranks
    for row in rows:
        assert row["sent"] == row["formula"] > 0, row
        assert row["flops"] == row["flops_formula"], row
    owner = [r["flops"] for r in rows if r["strategy"] == "fsdp" and r["mode"] == "owner"]
    gather = [r["flops"] for r in rows if r["strategy"] == "fsdp" and r["mode"] == "gather"]
    assert sum(owner) < sum(gather)  # FSDP cuts every matrix: gather repeats them
