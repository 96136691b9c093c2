"""Our LAMB, Lion and SophiaG step for step against library versions (or the paper's
algorithm box written out here) on the same gradients; every optimizer's declared state
bytes against the bytes it holds; each optimizer lowers a toy loss at its default lr."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from helpers import compose_config
from lion_pytorch import Lion as LibraryLion
from pytorch_optimizer import Lamb as LibraryLamb
from pytorch_optimizer import SophiaH
from torch import nn

from llm.config import OptimizerConfig
from llm.memory import model_state_bytes
from llm.optim import (
    OPTIMIZERS,
    Lamb,
    Lion,
    SophiaG,
    build_optimizer,
    declared_bytes_per_parameter,
    declared_state_bytes,
    param_groups,
    sampled_labels,
)

STEPS = 20


class TinyLM(nn.Module):
    """Embedding -> blocks (Linear + LayerNorm) -> untied head."""

    def __init__(self, vocab: int = 32, d: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(n_layers)
        )
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.layers:
            x = x + block(x)
        return self.head(x)


def _gradients(model: nn.Module, steps: int = STEPS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(steps)]


def _replay(model: nn.Module, optimizer, grads, between=None) -> None:
    """Step ``optimizer`` on the fixed gradients ``grads`` (one list per step)."""
    for step, step_grads in enumerate(grads):
        for p, grad in zip(model.parameters(), step_grads, strict=True):
            p.grad = grad.clone()
        if between is not None:
            between(step)
        optimizer.step()


def _twins():
    torch.manual_seed(0)
    model = TinyLM()
    return model, copy.deepcopy(model)


def _assert_same_weights(a: nn.Module, b: nn.Module, atol: float, rtol: float = 0.0) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=name)


def test_lion_matches_lion_pytorch():
    ours_model, lib_model = _twins()
    grads = _gradients(ours_model)
    ours = Lion(param_groups(ours_model, 0.3), lr=1e-3, betas=(0.9, 0.99))
    lib = LibraryLion(param_groups(lib_model, 0.3), lr=1e-3, betas=(0.9, 0.99))
    _replay(ours_model, ours, grads)
    _replay(lib_model, lib, grads)
    # The same operations in the same order: bit for bit (sign() makes any rounding
    # difference in the momentum a full lr step, so equality is the only useful tolerance).
    _assert_same_weights(ours_model, lib_model, atol=0.0)


def test_lamb_matches_pytorch_optimizer_lamb():
    """Without bias correction our LAMB is pytorch-optimizer's Lamb with weight decay inside
    the update (weight_decouple=False), no step-size debiasing (adam_debias=True) and its
    trust ratio switched off (adam=True) for the biases and norm gains."""
    ours_model, lib_model = _twins()
    grads = _gradients(ours_model)
    ours = Lamb(
        param_groups(ours_model, 0.01), lr=1e-2, eps=1e-6, bias_correction=False, trust_clip=10.0
    )
    lib_groups = param_groups(lib_model, 0.01)
    for group in lib_groups:
        group["adam"] = group["kind"] == "vector"
    lib = LibraryLamb(
        lib_groups, lr=1e-2, eps=1e-6, weight_decouple=False, adam_debias=True, foreach=False
    )
    _replay(ours_model, ours, grads)
    _replay(lib_model, lib, grads)
    # foreach kernels vs per-tensor ops, and sqrt/div in a different order: a few ulps.
    _assert_same_weights(ours_model, lib_model, atol=1e-6)


def _paper_lamb(model, grads, lr, wd, betas, eps, clip):
    """You et al. (2019), Algorithm 2 with bias-corrected moments, written per tensor."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in model.parameters()]
    v = [torch.zeros_like(p) for p in model.parameters()]
    with torch.no_grad():
        for t, step_grads in enumerate(grads, start=1):
            for i, (p, g) in enumerate(zip(model.parameters(), step_grads, strict=True)):
                m[i] = beta1 * m[i] + (1 - beta1) * g
                v[i] = beta2 * v[i] + (1 - beta2) * g * g
                r = (m[i] / (1 - beta1**t)) / ((v[i] / (1 - beta2**t)).sqrt() + eps)
                if p.dim() < 2:  # biases and gains: a plain Adam step, no decay
                    p -= lr * r
                    continue
                u = r + wd * p
                w_norm = p.norm().clamp(max=clip)
                ratio = w_norm / (u.norm() + eps) if w_norm > 0 and u.norm() > 0 else 1.0
                p -= lr * ratio * u


def test_lamb_with_bias_correction_matches_the_paper():
    ours_model, ref_model = _twins()
    grads = _gradients(ours_model)
    ours = Lamb(param_groups(ours_model, 0.01), lr=1e-2, eps=1e-6, trust_clip=0.5)
    _replay(ours_model, ours, grads)
    _paper_lamb(ref_model, grads, lr=1e-2, wd=0.01, betas=(0.9, 0.999), eps=1e-6, clip=0.5)
    # Our step folds the bias corrections into two scalars and the trust ratio into the
    # update's coefficients: after 20 steps a few ulps apart (2.5 ulps of a weight near 4).
    _assert_same_weights(ours_model, ref_model, atol=1e-7, rtol=1e-6)


def _paper_sophia(model, grads, estimates, lr, wd, betas, rho, eps, k):
    """Liu et al. (2023), Algorithm 3 (SophiaG), per tensor: h from B * g_hat^2 every k
    steps (t = 1, k + 1, ...), then decoupled decay and the clipped update."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in model.parameters()]
    h = [torch.zeros_like(p) for p in model.parameters()]
    with torch.no_grad():
        for t, step_grads in enumerate(grads, start=1):
            for i, (p, g) in enumerate(zip(model.parameters(), step_grads, strict=True)):
                m[i] = beta1 * m[i] + (1 - beta1) * g
                if t % k == 1 % k:
                    batch, g_hat = estimates[t]
                    h[i] = beta2 * h[i] + (1 - beta2) * batch * g_hat[i] * g_hat[i]
                decay = wd if p.dim() >= 2 else 0.0
                p *= 1 - lr * decay
                p -= lr * torch.clamp(m[i] / torch.clamp(rho * h[i], min=eps), -1.0, 1.0)


def _sophia_estimates(model, k: int) -> dict[int, tuple[float, list[torch.Tensor]]]:
    """The sampled-label gradients g_hat fed at steps 1, k + 1, ... and the batch size B."""
    g = torch.Generator().manual_seed(11)
    return {
        t: (96.0, [0.1 * torch.randn(p.shape, generator=g) for p in model.parameters()])
        for t in range(1, STEPS + 1, k)
    }


def _feed(model, optimizer, estimates):
    """Before step t (0-based here), hand SophiaG its estimate as the Trainer would."""

    def between(step: int) -> None:
        if optimizer.due(step + 1):
            saved = [p.grad for p in model.parameters()]
            batch, g_hat = estimates[step + 1]
            for p, e in zip(model.parameters(), g_hat, strict=True):
                p.grad = e.clone()
            optimizer.consume(torch.tensor(batch))
            for p, grad in zip(model.parameters(), saved, strict=True):
                p.grad = grad

    return between


def test_sophia_matches_the_paper_algorithm():
    ours_model, ref_model = _twins()
    grads, k = _gradients(ours_model), 4
    estimates = _sophia_estimates(ours_model, k)
    hyper = {"lr": 1e-3, "betas": (0.965, 0.99), "rho": 0.04, "eps": 1e-15}
    ours = SophiaG(param_groups(ours_model, 0.1), hessian_every=k, **hyper)
    _replay(ours_model, ours, grads, _feed(ours_model, ours, estimates))
    _paper_sophia(ref_model, grads, estimates, wd=0.1, k=k, **hyper)
    _assert_same_weights(ours_model, ref_model, atol=1e-6)


def test_sophia_update_equals_pytorch_optimizers_sophiah_given_the_same_estimates():
    """pytorch-optimizer has no SophiaG: its SophiaH estimates the Hessian by Hutchinson's
    method (a Hessian-vector product), another algorithm. Its update rule, fed our
    Gauss-Newton-Bartlett estimates through ``step(hessian=...)``, is SophiaG's:
    lr * clip(m / max(h, eps), p) equals our lr' * clip(m / max(rho h, eps'), 1) with
    p = rho, lr = lr' / rho, eps = eps' / rho and weight decay wd' * rho."""
    ours_model, lib_model = _twins()
    grads, k, rho = _gradients(ours_model), 4, 0.04
    estimates = _sophia_estimates(ours_model, k)
    ours = SophiaG(param_groups(ours_model, 0.1), lr=1e-3, rho=rho, eps=1e-15, hessian_every=k)
    _replay(ours_model, ours, grads, _feed(ours_model, ours, estimates))
    lib = SophiaH(
        param_groups(lib_model, 0.1 * rho),
        lr=1e-3 / rho,
        betas=(0.965, 0.99),
        p=rho,
        eps=1e-15 / rho,
        update_period=k,
        foreach=False,
    )
    for step, step_grads in enumerate(grads, start=1):
        for p, grad in zip(lib_model.parameters(), step_grads, strict=True):
            p.grad = grad.clone()
        if (step - 1) % k == 0:
            batch, g_hat = estimates[step]
            of = {id(p): batch * e * e for p, e in zip(lib_model.parameters(), g_hat, strict=True)}
            lib.step(hessian=[of[id(p)] for g in lib.param_groups for p in g["params"]])
        else:
            lib.step()
    # It forms the momentum with lerp (ours: mul + add) and divides the lr by rho: ulps.
    _assert_same_weights(ours_model, lib_model, atol=1e-5)


def test_sampled_labels_depend_on_the_row_not_on_its_batch():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 6))
    logits = torch.randn(4, 6, 32)
    targets = ids.clone()
    targets[1, 3:] = -100  # padding stays padding
    whole = sampled_labels(logits, targets, ids, seed=5)
    halves = torch.cat(
        [sampled_labels(logits[i : i + 2], targets[i : i + 2], ids[i : i + 2], 5) for i in (0, 2)]
    )
    assert torch.equal(whole, halves)
    assert (whole[1, 3:] == -100).all() and (whole[targets != -100] >= 0).all()
    assert not torch.equal(whole, sampled_labels(logits, targets, ids, seed=6))
    # Drawn from softmax(logits): a sharply peaked row yields its argmax.
    peaked = torch.full((1, 6, 32), -50.0).scatter_(2, ids[:1, :, None], 50.0)
    assert torch.equal(sampled_labels(peaked, ids[:1], ids[:1], seed=1), ids[:1])


@functools.cache
def _defaults(name: str) -> OptimizerConfig:
    """conf/optimizer/NAME.yaml, composed as train.py does."""
    return compose_config([f"optimizer={name}", "output_dir=unused"]).optimizer


def _toy_steps(name: str, steps: int = 15, **overrides):
    cfg = dataclasses.replace(_defaults(name), **overrides)
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = build_optimizer(model, cfg)
    idx = torch.randint(0, 32, (8, 12))
    targets = torch.roll(idx, 1, dims=1)

    def loss_fn() -> torch.Tensor:
        return nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())

    first = loss_fn().item()
    for step in range(1, steps + 1):
        extra = getattr(optimizer, "gradient_pass", None)
        if extra is not None and extra.due(step):
            extra.loss(model(idx), targets, idx, seed=step).div(idx.numel()).backward()
            extra.consume(torch.tensor(float(idx.numel())))
            optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, cfg, first, loss_fn().item()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_lowers_a_toy_loss_at_its_default_lr(name):
    *_, first, last = _toy_steps(name)
    assert last < first - 0.01, (first, last)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_declared_state_bytes_match_the_measured_optimizer_states(name):
    """The figure each optimizer declares (llm/optim/builders.py) is what llm.memory counts
    in its tensor storages, exactly; min_8bit_size is lowered so that 8-bit AdamW quantises
    the toy model's matrices."""
    model, optimizer, cfg, *_ = _toy_steps(name, 2, min_8bit_size=256)
    measured = model_state_bytes(model, optimizer)["optimizer_states"]
    assert measured == declared_state_bytes(optimizer, cfg) > 0


def test_muon_orthogonalises_hidden_matrices_only():
    model, optimizer, *_ = _toy_steps("muon", steps=1)
    hidden = {id(p) for block in model.layers for p in block.parameters() if p.dim() == 2}
    for group in optimizer.param_groups:
        for p in group["params"]:
            keys = set(optimizer.state[p])
            if id(p) in hidden:
                assert group["kind"] == "hidden" and keys == {"momentum_buffer"}
            else:  # embeddings, head, gains and biases: AdamW
                assert group["kind"] != "hidden" and {"exp_avg", "exp_avg_sq"} <= keys


def test_adamw8bit_stores_uint8_moments_on_cpu():
    cfg = OptimizerConfig(name="adamw8bit", min_8bit_size=256)
    model = TinyLM()
    optimizer = build_optimizer(model, cfg)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.head.weight]  # 512 elements: quantised
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    # A gpt2-small MLP matrix: two bytes per element plus an fp32 absmax per 256 of each.
    matrix = [((768, 3072), "matrix")]
    assert declared_bytes_per_parameter(cfg, matrix) == pytest.approx(2 + 8 / 256, rel=1e-3)
    assert declared_bytes_per_parameter(OptimizerConfig(), matrix) == pytest.approx(8, rel=1e-5)
