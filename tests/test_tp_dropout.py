"""Dropout masks under tensor parallel (llm/parallel/tp_rng.py): which stream each dropout
draws from, on 2 gloo ranks (tp=2) and in one process.

A mask is read where dropout makes it: every ``bernoulli_`` of a training forward (CPU
dropout fills a keep-mask with it), in call order: the embedding dropout, then per block the
attention probabilities (B, H/tp, T, T), the attention's and the MLP's residual dropouts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import run, train_losses
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from llm.config import RecomputeConfig
from llm.launch.launcher import free_port
from llm.models import InitSource, build_model, materialize_from, model_args
from llm.parallel.tensor_parallel import (
    align_grads,
    apply_tensor_parallel,
    local_tensor,
    loss_parallel,
    tp_copies,
)
from llm.parallel.tp_rng import RankStream
from llm.recompute import RECOMPUTE_POLICIES, recompute_policy

CPU = torch.device("cpu")
WORLD = 2
DROPOUT = 0.3
VOCAB = 256  # a multiple of tp: no padding
POLICIES = ("full", "selective", "op_sac")
# Each family once, each side of sequence parallel once (both families under both cost the
# fast suite twice the time and exercise no other code).
CASES = [("gpt2-tiny", False), ("llama-tiny", True)]


class DropoutMasks(TorchDispatchMode):
    """Records the positions each dropout drops (True), in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.dropped.append(out == 0)
        return out


def _model(mesh, family: str, sp: bool, recompute: str = "none"):
    args = model_args(family, vocab_size=VOCAB, dropout=DROPOUT)
    model = apply_tensor_parallel(build_model(args), mesh, sequence_parallel=sp)
    recompute_policy(RecomputeConfig(name=recompute)).apply(model)
    materialize_from(model, InitSource(args, seed=0), CPU)
    return model.train()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _backward(model, tokens: torch.Tensor) -> None:
    """The Trainer's loss on shifted tokens, vocab-parallel; gradients in their parameters'
    placements."""
    with loss_parallel():
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    align_grads(model)


def _replicated(model) -> dict[str, torch.Tensor]:
    """The parameters every tp rank holds whole (norm gains, row-parallel biases; DTensors
    under sequence parallel's norms)."""
    return {
        n: local_tensor(p).detach().clone()
        for n, p in model.named_parameters()
        if tp_copies(p, WORLD) == WORLD
    }


def _block_outputs(model) -> tuple[list[torch.Tensor], list]:
    outputs: list[torch.Tensor] = []
    hooks = [
        b.register_forward_hook(lambda m, i, o: outputs.append(o.detach())) for b in model.layers
    ]
    return outputs, hooks


def _masks_and_replicas(mesh, family: str, sp: bool) -> dict:
    """One training step with dropout: this rank's masks, its block outputs (the residual
    stream) in the step and in a forward after it, and its replicated parameters after it."""
    torch.manual_seed(0)  # as llm.run seeds every rank
    model = _model(mesh, family, sp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs, hooks = _block_outputs(model)
    masks = DropoutMasks()
    with masks:
        _backward(model, _tokens())
    optimizer.step()
    with torch.no_grad():
        model(_tokens())
    for hook in hooks:
        hook.remove()
    return {"masks": masks.dropped, "outputs": outputs, "replicated": _replicated(model)}


def _grads(mesh, family: str, sp: bool, recompute: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = _model(mesh, family, sp, recompute)
    _backward(model, _tokens())
    return {n: local_tensor(p.grad).clone() for n, p in model.state_dict(keep_vars=True).items()}


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for family, sp in CASES:
            results[("step", family, sp, rank)] = _masks_and_replicas(mesh, family, sp)
            grads = {p: _grads(mesh, family, sp, p, seed=0) for p in ("none", *POLICIES)}
            grads["other seed"] = _grads(mesh, family, sp, "none", seed=1)
            results[("grads", family, sp, rank)] = grads
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict:
    results = mp.Manager().dict()
    mp.start_processes(
        _rank, args=(WORLD, free_port(), results), nprocs=WORLD, start_method="spawn"
    )
    return dict(results)


@pytest.mark.parametrize(("family", "sp"), CASES)
@pytest.mark.slow
def test_masks_differ_where_ranks_hold_different_elements(ranks, family, sp):
    """Attention-probability masks (local heads) differ between the tp ranks; the embedding
    and residual masks differ under sequence parallel (sequence shards) and are the same
    without it (the replicated residual stream). Each rank still drops DROPOUT of them."""
    masks = [ranks[("step", family, sp, r)]["masks"] for r in range(WORLD)]
    n_layers = model_args(family).n_layers
    assert len(masks[0]) == len(masks[1]) == 1 + 3 * n_layers
    for i, (a, b) in enumerate(zip(*masks, strict=True)):
        heads = a.dim() == 4  # (B, H/tp, T, T)
        assert a.shape == b.shape
        assert torch.equal(a, b) != (heads or sp), (i, tuple(a.shape))
        if not heads:  # a residual mask covers this rank's tokens only under SP
            assert a.shape[1] == (16 // WORLD if sp else 16)
    for rank_masks in masks:
        dropped = torch.cat([m.flatten() for m in rank_masks]).float().mean().item()
        assert abs(dropped - DROPOUT) < 0.02


@pytest.mark.parametrize(("family", "sp"), CASES)
def test_replicas_stay_identical_after_a_step_with_dropout(ranks, family, sp):
    """The replicated parameters are bitwise equal on both tp ranks after an optimizer step
    with dropout (the all-reduce gives both ranks the same bits); without sequence parallel
    the residual stream is too, in the step and in the forward after it."""
    step = [ranks[("step", family, sp, r)] for r in range(WORLD)]
    replicated = [s["replicated"] for s in step]
    assert replicated[0].keys() == replicated[1].keys() != set()
    for name, value in replicated[0].items():
        assert torch.equal(value, replicated[1][name]), name
    outputs = [s["outputs"] for s in step]
    assert len(outputs[0]) == 2 * model_args(family).n_layers
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b) != sp  # under SP each rank holds other tokens


@pytest.mark.parametrize(("family", "sp"), CASES)
@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_replays_the_rank_masks(ranks, family, sp, policy):
    """Recompute under tp with dropout gives the gradients of no recompute with the same
    seed, on each rank (the rank stream is replayed in backward); another seed gives other
    gradients, so the masks do reach them. Same ops in the same order, fp32: allclose at
    torch's default fp32 tolerance (1.3e-6 relative)."""
    for rank in range(WORLD):
        grads = ranks[("grads", family, sp, rank)]
        reference = grads["none"]
        assert grads[policy].keys() == reference.keys()
        for name, grad in grads[policy].items():
            torch.testing.assert_close(grad, reference[name], msg=f"{name} on rank {rank}")
        assert any(not torch.allclose(grads["other seed"][n], g) for n, g in reference.items())


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _states(device: str) -> list[torch.Tensor]:
    """The shared stream: the CPU generator's state, and the accelerator's."""
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device == "cuda" else [])


def _restore(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def _dropped(rank: int, device: str) -> torch.Tensor:
    stream = RankStream(rank, WORLD, device)
    return stream.call(F.dropout, torch.ones(64, 64, device=device), DROPOUT) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_rank_stream_is_a_function_of_the_shared_stream(device):
    """From one shared state the two ranks' masks differ; each rank's masks come again after
    the state is restored (what recompute and a resumed checkpoint do); and a fork advances
    the shared stream by one CPU draw on every rank, whatever ran inside it (the
    accelerator's shared state is left as it was)."""
    torch.manual_seed(0)
    shared = _states(device)
    rank0 = _dropped(0, device)
    after_fork = _states(device)
    _restore(shared)
    rank1 = _dropped(1, device)
    assert all(torch.equal(a, b) for a, b in zip(_states(device), after_fork, strict=True))
    assert not torch.equal(rank0, rank1)
    _restore(shared)
    assert torch.equal(_dropped(0, device), rank0)
    _restore(shared)
    torch.randint(2**32 // WORLD, ())
    assert all(torch.equal(a, b) for a, b in zip(_states(device), after_fork, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_replays_the_rank_stream(device):
    """torch.utils.checkpoint around a rank-stream dropout gives the gradient of the plain
    call with the same seed (the model-level tests above cover CPU; this one the
    accelerator's generator too)."""
    stream = RankStream(1, WORLD, device)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return stream.call(F.dropout, x.sin(), DROPOUT).exp()

    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        x = torch.randn(64, 64, device=device, requires_grad=True)
        y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        y.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert (grads[0] == 0).float().mean().item() == pytest.approx(DROPOUT, abs=0.03)


def test_recompute_policies_cover_every_checkpointing_policy():
    """The policies replayed above are every one that recomputes dropout in backward (budget
    is torch.compile's partitioner, offload recomputes nothing)."""
    assert set(RECOMPUTE_POLICIES) - {"none", "budget", "offload"} == set(POLICIES)


@pytest.mark.slow  # two 2-rank runs: 100 s on this machine's shared cores
def test_a_resumed_tp_run_continues_its_masks(tmp_path, text_corpus, cache_dir):
    """tp=2 with sequence parallel and dropout, checkpointed after step 2 and resumed at
    tp=2: steps 3-4 equal the uninterrupted run's bit for bit, since the checkpoint's RNG
    files restore the shared stream the rank streams derive from."""
    steps = 4
    common = (
        "model=llama-tiny",
        "launcher.nproc_per_node=2",
        "parallelism.tp_size=2",
        "parallelism.sequence_parallel=true",
        f"model.dropout={DROPOUT}",
        f"train.max_steps={steps}",
    )
    _, whole = run(tmp_path, "whole", text_corpus, cache_dir, *common, "checkpoint.every=2")
    checkpoint = whole / "checkpoints" / "step_000002"
    _, resumed = run(
        tmp_path, "resumed", text_corpus, cache_dir, *common, f"checkpoint.resume={checkpoint}"
    )
    expected = train_losses(whole)
    assert train_losses(resumed) == {s: expected[s] for s in (3, 4)}
