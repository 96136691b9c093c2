"""The MoE block (llm/models/moe.py) in one process: the two expert kernels agree, routing
and capacity follow their rules, the losses are the published formulas, the sigmoid
router's bias moves towards balance, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llm.errors import ConfigError
from llm.models import build_model, materialize, model_args
from llm.models.moe import MoE, moe_layers


def _moe(**changes) -> MoE:
    args = model_args("moe-tiny")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **changes))
    model = materialize(build_model(args), "cpu", seed=1)
    return model.layers[0].feed_forward.train()


def _x(seed=0, n=64):
    return torch.randn(2, n // 2, 64, generator=torch.Generator().manual_seed(seed))


def _by_hand(layer: MoE, x):
    """Each token through its top-k experts, one token at a time."""
    h = x.reshape(-1, x.size(-1))
    probs = layer.router.gate(h).float().softmax(-1)
    w, idx = probs.topk(layer.moe.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    e = layer.experts
    out = torch.zeros_like(h)
    for t in range(h.size(0)):
        for j in range(layer.moe.top_k):
            k = idx[t, j]
            y = F.silu(h[t] @ e.w1[k].T) * (h[t] @ e.w3[k].T) @ e.w2[k].T
            out[t] += w[t, j] * y
    return out.view_as(x)


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_each_kernel_equals_the_per_token_computation(kernel):
    layer = _moe(kernel=kernel)
    x = _x()
    torch.testing.assert_close(layer(x), _by_hand(layer, x), rtol=1e-5, atol=1e-6)


def test_grouped_and_loop_kernels_have_the_same_gradients():
    x = _x(1)
    grads = {}
    for kernel in ("loop", "grouped"):
        layer = _moe(kernel=kernel)
        xi = x.clone().requires_grad_(True)
        layer(xi).square().sum().backward()
        grads[kernel] = [xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["loop"], grads["grouped"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_balance_and_z_losses_follow_their_formulas():
    layer = _moe(aux_loss_coef=0.5, z_loss_coef=0.25)
    x = _x(2)
    layer(x)
    logits = layer.router.gate(x.reshape(-1, 64)).float()
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=8).float()
    balance = 8 * (counts / counts.sum() * probs.mean(0)).sum()  # Switch eq. 4
    z = torch.logsumexp(logits, -1).square().mean()  # ST-MoE eq. 5
    torch.testing.assert_close(layer.balance_loss, balance)
    torch.testing.assert_close(layer.z_loss, z)
    torch.testing.assert_close(layer.aux_loss.detach(), 0.5 * balance + 0.25 * z)
    torch.testing.assert_close(layer.load.float(), counts)


def test_capacity_keeps_the_first_tokens_of_each_expert():
    layer = _moe(capacity_factor=0.5)
    x = _x(3)
    y = layer(x)
    h = x.reshape(-1, 64)
    idx = layer.router(h).experts  # (N, k)
    cap = int(torch.ceil(torch.tensor(idx.numel() * 0.5 / 8)))
    seen = torch.zeros(8, dtype=torch.long)
    kept = torch.zeros_like(idx, dtype=torch.bool)
    for t in range(idx.size(0)):  # token order, slot order within a token
        for j in range(idx.size(1)):
            e = idx[t, j]
            kept[t, j] = seen[e] < cap
            seen[e] += 1
    assert 0 < int(kept.sum()) < idx.numel()
    assert layer.kept == int(kept.sum())
    # A token with no kept slot passes nothing through the experts.
    none = ~kept.any(1)
    assert none.any()
    assert torch.all(y.reshape(-1, 64)[none] == 0)


def test_shared_experts_add_to_every_token():
    layer = _moe(n_shared_experts=2)
    x = _x(4)
    routed = layer(x) - layer.shared(x.reshape(-1, 64)).view_as(x)
    layer.shared = None
    torch.testing.assert_close(routed, layer(x), rtol=1e-5, atol=1e-6)


def test_sigmoid_bias_moves_towards_balance_and_picks_but_does_not_weigh():
    layer = _moe(router="sigmoid", bias_update_rate=0.1)
    load = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])
    layer.router.update_bias(load)
    assert layer.router.bias[0] < 0 < layer.router.bias[1]
    layer.router.update_bias(load, applied=torch.tensor(0.0))  # a skipped step
    assert layer.router.bias[0] == pytest.approx(-0.1)
    h = _x(5).reshape(-1, 64)
    layer.router.bias.zero_()
    layer.router.bias[3] = 10.0  # expert 3 is picked by every token...
    route = layer.router(h)
    assert torch.all((route.experts == 3).any(-1))
    scores = layer.router.gate(h).float().sigmoid()
    picked = scores.gather(-1, route.experts)  # ...weighted by its score, not the bias
    torch.testing.assert_close(route.weights, picked / picked.sum(-1, keepdim=True))


def test_every_and_first_dense_place_the_moe_blocks():
    args = model_args("moe-tiny", n_layers=6, moe={"every": 2, "first_dense": 1})
    model = build_model(args)
    moe_at = [i for i, b in enumerate(model.layers) if isinstance(b.feed_forward, MoE)]
    assert moe_at == [1, 3, 5]
    assert len(moe_layers(model)) == 3


@pytest.mark.parametrize(
    ("name", "moe", "message"),
    [
        ("moe-tiny", {"top_k": 9}, "top_k=9 exceeds model.moe.n_experts=8"),
        (
            "llama-tiny",
            {"n_experts": 4},
            "model.moe.n_experts is set but model llama-tiny is dense",
        ),
        ("moe-tiny", {"router": "noisy"}, "model.moe.router='noisy' is unknown"),
        (
            "moe-tiny",
            {"balance_loss": "global"},
            "model.moe.balance_loss='global' is unknown; choose one of per_layer, pooled",
        ),
        ("moe-tiny", {"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
    ],
)
def test_bad_moe_settings_are_refused_in_one_line(name, moe, message):
    with pytest.raises(ConfigError) as err:
        model_args(name, moe=moe)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gpt2_shapes_take_no_experts():
    base = model_args("gpt2-tiny")
    with pytest.raises(ConfigError, match="experts are SwiGLU MLPs of the llama family"):
        dataclasses.replace(base, moe=model_args("moe-tiny").moe)
