"""Our ZeRO stages driven through the strategy API in spawned gloo ranks, against a
single-process reference: parameters some rank leaves unused, and frozen parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import zero_whole_weights
from torch import nn

from llm.config import OptimizerConfig, ParallelismConfig
from llm.launch.launcher import free_port
from llm.models import build_model, materialize, model_args
from llm.optim import build_optimizer
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision

CPU = torch.device("cpu")
WORLD = 2
STEPS = 3
OPTIM = OptimizerConfig(lr=1e-2)


def _spawn(fn, *args) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(
        fn, args=(WORLD, free_port(), results, *args), nprocs=WORLD, start_method="spawn"
    )
    return dict(results)


def _zero(stage: int, rank: int, bucket_cap_mb: float):
    return build_strategy(
        ParallelismConfig(name=f"zero{stage}", bucket_cap_mb=bucket_cap_mb),
        ParallelDims.from_config(-1, 1, 1, WORLD, rank),
        resolve_precision("fp32", CPU),
        CPU,
    )


def _train_zero(strategy, model, loss_of, batches) -> list[float]:
    """STEPS steps on this rank's batches; returns the global gradient norms."""
    strategy.build_optimizer(strategy.wrap(model), OPTIM)
    norms = []
    for batch in batches:
        with strategy.micro_batch(sync=True):
            strategy.backward(loss_of(model, batch))
        norms.append(strategy.clip_and_step(max_norm=0.0).grad_norm)
        strategy.zero_grad()
    return norms


def _train_reference(model, loss_of, batches_per_rank) -> tuple[dict, list[float]]:
    """One process over every rank's batch: the mean of the ranks' losses (what averaged
    gradients compute)."""
    optimizer = build_optimizer(model, OPTIM)
    norms = []
    for step in range(STEPS):
        loss = sum(loss_of(model, rank[step]) for rank in batches_per_rank) / WORLD
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.stack([g.norm() for g in grads]).norm()))
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


# ---- a parameter unused on one rank ----------------------------------------------------
class BranchBlock(nn.Module):
    """x + tanh(a(x)) or x + tanh(b(x)): the data picks one, the other gets no gradient."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return x + torch.tanh((self.a if use_a else self.b)(x))


class Branchy(nn.Module):
    def __init__(self, d: int = 16, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(BranchBlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_a = bool(x[:, 0].mean() > 0)  # data-dependent control flow
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, use_a)
        return self.head(h)


def _branch_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 16, generator=g) for _ in range(STEPS)]
    for x in batches:
        x[:, 0] = 1.0 if rank == 0 else -1.0  # rank 0 uses the `a` linears, rank 1 `b`
    return batches


def _branch_loss(model, x):
    return model(x).pow(2).mean()


def _unused_rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = Branchy()
            # Small buckets: several per block, so the order of launches matters.
            strategy = _zero(stage, rank, bucket_cap_mb=0.001)
            norms = _train_zero(strategy, model, _branch_loss, _branch_batches(rank))
            results[(stage, rank)] = (zero_whole_weights(strategy), norms)
    finally:
        dist.destroy_process_group()


def test_parameters_unused_on_one_rank_keep_collectives_in_order():
    """Each rank leaves the other's branch unused: its buckets complete in another order,
    yet every rank launches the same collectives in the same order (else gloo would pair
    different buckets, or hang), and the result is the single-process one."""
    results = _spawn(_unused_rank)
    torch.manual_seed(0)
    ref_weights, ref_norms = _train_reference(
        Branchy(), _branch_loss, [_branch_batches(r) for r in range(WORLD)]
    )
    for stage in (1, 2, 3):
        for rank in range(WORLD):
            weights, norms = results[(stage, rank)]
            assert norms == pytest.approx(ref_norms, rel=1e-5), (stage, rank)
            for name, want in ref_weights.items():
                torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=name)


# ---- frozen parameters -----------------------------------------------------------------
FROZEN = {
    # The embeddings and the whole first block (a fully frozen gather unit under zero3).
    "embeddings_and_first_block": ("tok_embeddings.", "pos_embeddings.", "layers.0."),
    # The whole root: embeddings, the final norm and the (tied) head.
    "root": ("tok_embeddings.", "pos_embeddings.", "norm."),
}


def _gpt(frozen: tuple[str, ...]) -> nn.Module:
    model = materialize(build_model(model_args("gpt2-tiny", vocab_size=64)), CPU, 0)
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    return model


def _token_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randint(0, 64, (2, 17), generator=g) for _ in range(STEPS)]


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _frozen_rank(rank: int, world: int, port: int, results, frozen) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for stage in (1, 2, 3):
            model = _gpt(frozen)
            strategy = _zero(stage, rank, bucket_cap_mb=0.01)
            _train_zero(strategy, model, _lm_loss, _token_batches(rank))
            frozen_grads = [
                n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
            ]
            states = [len(s) for s in strategy.optimizer.state.values()]
            results[(stage, rank)] = {
                "weights": zero_whole_weights(strategy),
                "piece_names": {piece.slot.name for piece, _ in strategy.piece_params},
                "pieces": len(strategy.piece_params),
                "states": states,
                "frozen_grads": frozen_grads,
                "memory": strategy.memory(),
            }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", sorted(FROZEN))
def test_frozen_parameters_get_no_gradient_state_or_update(which):
    frozen = FROZEN[which]
    results = _spawn(_frozen_rank, frozen)
    model = _gpt(frozen)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen_names and trainable
    ref_weights, _ = _train_reference(model, _lm_loss, [_token_batches(r) for r in range(WORLD)])
    for stage in (1, 2, 3):
        ranks = [results[(stage, r)] for r in range(WORLD)]
        for got in ranks:
            assert not got["frozen_grads"]
            assert not got["piece_names"] & frozen_names
            for name, want in ref_weights.items():
                torch.testing.assert_close(got["weights"][name], want, rtol=1e-4, atol=1e-6)
            for name in frozen_names:
                assert torch.equal(got["weights"][name], init[name]), name
            assert got["states"] == [3] * got["pieces"]  # AdamW: step, exp_avg, exp_avg_sq
        # The saving, in the accounting: fp32 moments (8 bytes) and a 4-byte step per piece
        # for trainable elements only, summed over the ranks that own them.
        states = sum(got["memory"]["optimizer_states"] for got in ranks)
        assert states == 8 * trainable + 4 * sum(got["pieces"] for got in ranks), stage
