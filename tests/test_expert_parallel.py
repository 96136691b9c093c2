"""One MoE layer under expert parallelism (llm/parallel/experts/) in spawned gloo
ranks against one process that runs the whole batch: outputs, input gradients, expert and
router gradients, the balance loss, the dropped tokens of a capacity, and the all-to-all
bytes against their formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llm.launch.launcher import free_port
from llm.models import model_args
from llm.models.moe import MoE
from llm.models.weights import InitSource
from llm.parallel.experts.exchange import _padded_places
from llm.parallel.experts.install import expert_mesh, expert_range, install

BATCH, SEQ = 8, 12  # global: BATCH / world sequences per rank
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32; rows reach the experts in another order per layout


def _args(capacity: float | None, router: str = "softmax", kernel: str = "loop"):
    """moe-tiny's shape; the balance loss weighted 1 so its gradient is tested as well.
    The loop kernel takes the exact exchange, the grouped one the padded exchange."""
    args = model_args("moe-tiny")
    moe = dataclasses.replace(
        args.moe, capacity_factor=capacity, router=router, kernel=kernel, aux_loss_coef=1.0
    )
    return dataclasses.replace(args, moe=moe)


def _layer(args) -> MoE:
    """The first block's MoE with seeded init (the same bits in every process)."""
    layer = MoE(args)
    source = InitSource(args, seed=3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(source.whole(f"layers.0.feed_forward.{name}", torch.device("cpu")))
        if args.moe.router == "sigmoid":  # a bias that changes which experts are picked
            layer.router.bias.copy_(torch.linspace(-0.3, 0.3, args.moe.n_experts))
    return layer.train()


def _inputs(args):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, args.d_model, generator=g)
    r = torch.randn(BATCH, SEQ, args.d_model, generator=g)
    return x, r


def _reference(args) -> dict:
    layer = _layer(args)
    x, r = _inputs(args)
    x.requires_grad_(True)
    y = layer(x)
    ((y * r).sum() + layer.aux_loss).backward()
    experts = layer.router(x.detach().reshape(-1, args.d_model)).experts
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
        "balance": layer.balance_loss,
        "load": layer.load,
        "kept": layer.kept,
        "experts": experts,
    }


def _rank(rank, world, port, results, ep, capacity, router, kernel):
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}"
    )
    args = _args(capacity, router, kernel)
    mesh = expert_mesh("cpu", world, ep)
    layer = _layer(args)
    install(layer, dist.group.WORLD, mesh)
    x, r = _inputs(args)
    per = BATCH // world
    mine = slice(rank * per, (rank + 1) * per)
    x = x[mine].clone().requires_grad_(True)
    y = layer(x)
    # The mean over ranks of each rank's balance loss is the global batch's.
    ((y * r[mine]).sum() + layer.aux_loss / world).backward()
    grads = {}
    for name, param in layer.named_parameters():
        grad = param.grad.clone()
        # Expert gradients sum over the ranks that hold the same experts, the rest over all.
        dist.all_reduce(grad, group=mesh["edp"].get_group() if "experts" in name else None)
        grads[name] = grad
    results[rank] = {
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": grads,
        "balance": layer.balance_loss,
        "load": layer.load,
        "kept": layer.kept,
        "sent": layer.exchange.take_sent(),
    }
    dist.destroy_process_group()


def _spawn(world, ep, capacity=None, router="softmax", kernel="loop") -> dict:
    results = mp.Manager().dict()
    mp.start_processes(
        _rank,
        args=(world, free_port(), results, ep, capacity, router, kernel),
        nprocs=world,
        start_method="spawn",
    )
    return dict(results)


def _check_against_reference(world, ep, capacity, router, kernel="loop"):
    args = _args(capacity, router, kernel)
    ref = _reference(args)
    ranks = _spawn(world, ep, capacity, router, kernel)
    per = BATCH // world
    for rank, got in ranks.items():
        mine = slice(rank * per, (rank + 1) * per)
        torch.testing.assert_close(got["y"], ref["y"][mine], **TOL)
        torch.testing.assert_close(got["x_grad"], ref["x_grad"][mine], **TOL)
        torch.testing.assert_close(got["load"], ref["load"])  # global counts, exact
        assert got["kept"] == ref["kept"]
        lo, hi = expert_range(args.moe.n_experts, ep, rank % ep)
        for name, grad in got["grads"].items():
            want = ref["grads"][name][lo:hi] if "experts" in name else ref["grads"][name]
            torch.testing.assert_close(grad, want, **TOL, msg=f"{name} on rank {rank}")
    mean_balance = sum(float(g["balance"]) for g in ranks.values()) / world
    assert mean_balance == pytest.approx(float(ref["balance"]), rel=1e-6)
    return args, ref, ranks


@pytest.mark.parametrize(
    ("world", "ep"),
    [
        pytest.param(2, 1, marks=pytest.mark.slow),
        (2, 2),
        pytest.param(4, 2, marks=pytest.mark.slow),
        (4, 4),
    ],
)
@pytest.mark.slow
def test_expert_parallel_layer_equals_one_process(world, ep):
    """Dropless routing: every layout's outputs and gradients are one process's, and the
    all-to-all bytes are 4 x (assignments that leave their rank) x d_model x 4 bytes, summed
    over ranks (dispatch and combine, forward and backward)."""
    args, ref, ranks = _check_against_reference(world, ep, None, "softmax")
    tokens_per_rank = BATCH // world * SEQ
    token_rank = torch.arange(BATCH * SEQ) // tokens_per_rank
    expert_rank = ref["experts"] // (args.moe.n_experts // ep)  # (N, k): ep rank of the expert
    leaving = int((expert_rank != (token_rank % ep).unsqueeze(1)).sum())
    sent = sum(g["sent"].get("all_to_all", 0) for g in ranks.values())
    assert sent == 4 * leaving * args.d_model * 4
    assert (leaving > 0) == (ep > 1)


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2)])
@pytest.mark.slow
def test_padded_exchange_equals_one_process(world, ep):
    """The grouped kernel's padded exchange: outputs and gradients are one process's, and
    each rank sends each other rank of its ep group a block of tokens x min(top_k, E/ep)
    rows, four times (dispatch and combine, forward and backward), whatever the routing."""
    args, _, ranks = _check_against_reference(world, ep, None, "softmax", "grouped")
    block = BATCH // world * SEQ * min(args.moe.top_k, args.moe.n_experts // ep)
    for got in ranks.values():
        assert got["sent"]["all_to_all"] == 4 * (ep - 1) * block * args.d_model * 4


@pytest.mark.slow
def test_padded_exchange_with_a_capacity_equals_one_process():
    """Ranks keep different numbers of rows under a capacity; the blocks stay one size."""
    _, ref, _ = _check_against_reference(4, 2, 0.5, "softmax", "grouped")
    assert ref["kept"] < ref["load"].sum()


@pytest.mark.slow
def test_capacity_drops_the_same_tokens_as_one_process():
    """A capacity below the load: the global queue's first come are kept on every layout,
    so outputs (dropped assignments contribute nothing) and gradients are one process's."""
    _, ref, _ = _check_against_reference(4, 2, 0.5, "softmax")
    assert ref["kept"] < ref["load"].sum()  # the capacity did drop assignments


@pytest.mark.slow
def test_sigmoid_router_with_bias_under_expert_parallelism():
    _check_against_reference(2, 2, None, "sigmoid")


def test_padded_blocks_regroup_by_expert_then_source_with_the_padding_last():
    """The padded exchange's receiver: blocks of 5 rows from 3 sources, each holding its
    rows per local expert (2 experts) and then padding, land in (expert, source) order,
    padding after every real row, in source order; checked against a list built by hand."""
    received = torch.tensor([[2, 1], [0, 3], [1, 0]])
    block = 5
    place = _padded_places(received, block)
    rows = []  # (expert, source, index in run) or (padding, source, j)
    for s in range(3):
        j = 0
        for e in range(2):
            for i in range(int(received[s, e])):
                rows.append((0, e, s, i))
                j += 1
        rows += [(1, 0, s, k) for k in range(j, block)]
    want = sorted(range(len(rows)), key=lambda r: rows[r])  # real rows by (expert, source)
    assert sorted(place.tolist()) == list(range(3 * block))
    assert [want.index(r) for r in range(len(rows))] == place.tolist()
