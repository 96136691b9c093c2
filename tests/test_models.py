"""Shapes, counts, init and the causal-LM behaviour of both families (CPU, tiny shapes)."""

import dataclasses

import psutil
import pytest
import torch
import torch.nn.functional as F

from llm.errors import ConfigError
from llm.models import (
    MODEL_SHAPES,
    build_model,
    causal_flops_per_token,
    flops_per_token,
    materialize,
    model_args,
    num_params,
)

TINY = ["gpt2-tiny", "llama-tiny"]


def _unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_every_shape_builds_on_meta_and_counts_match(name):
    model = build_model(MODEL_SHAPES[name])
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _unique_numel(model) == num_params(MODEL_SHAPES[name])
    assert len(model.layers) == MODEL_SHAPES[name].n_layers


def test_meta_build_of_an_8b_model_allocates_nothing():
    rss = psutil.Process().memory_info().rss
    model = build_model(MODEL_SHAPES["llama3-8b"])  # 32 GB if it were materialised in fp32
    assert psutil.Process().memory_info().rss - rss < 64 * 2**20
    assert model.layers[0].attention.wk.weight.shape == (1024, 4096)  # 8 kv heads x 128


def test_published_parameter_counts():
    assert num_params(MODEL_SHAPES["gpt2-small"]) == 124_439_808  # tied embeddings
    assert num_params(MODEL_SHAPES["gpt2-small"], exclude_embeddings=True) == 85_056_000
    assert num_params(MODEL_SHAPES["llama2-7b"]) == 6_738_415_616  # "6.74B"
    assert num_params(MODEL_SHAPES["llama3-8b"]) == 8_030_261_248  # "8.03B"
    assert num_params(MODEL_SHAPES["llama-1b"]) == 1_235_814_400  # Llama-3.2-1B, tied


def test_flops_per_token_by_hand():
    a = MODEL_SHAPES["gpt2-small"]
    # N: body + output projection (tied, still a matmul) = nanoGPT's
    # get_num_params(non_embedding=True), which drops only the position table.
    n_matmul = 85_056_000 + 50257 * 768
    assert n_matmul == num_params(a) - 1024 * 768 == 123_653_376
    # nanoGPT's estimate_mfu / PaLM: 6N + 12 * L * H * Q * T, every score counted.
    assert flops_per_token(a, 1024) == 6 * n_matmul + 12 * 12 * 12 * 64 * 1024 == 855_166_464
    # What a causal kernel computes: position i scores i + 1 keys, (T + 1) / 2 on average.
    assert causal_flops_per_token(a, 1024) == 6 * n_matmul + 6 * 12 * 1025 * 768 == 798_598_656
    # GQA keeps the attention terms (queries keep n_heads) and shrinks N by the k/v projections.
    mha = model_args("llama-tiny", n_kv_heads=4)
    gqa = model_args("llama-tiny")  # n_kv_heads=2, head_dim 16
    saved_params = gqa.n_layers * 2 * gqa.d_model * (4 - 2) * gqa.head_dim
    for count in (flops_per_token, causal_flops_per_token):
        assert count(mha, 128) - count(gqa, 128) == 6 * saved_params


def test_model_args_overrides_and_errors():
    assert model_args("gpt2-mini", d_model=None, n_layers=None) == MODEL_SHAPES["gpt2-mini"]
    a = model_args("gpt2-tiny", n_heads=8, d_model=128, vocab_size=100)
    assert (a.n_kv_heads, a.d_ff, a.vocab_size) == (8, 512, 100)  # MHA and 4*d follow
    with pytest.raises(ConfigError, match="unknown; choose one of gpt2-tiny"):
        model_args("gpt3")
    with pytest.raises(ConfigError, match=r"not divisible by model\.n_heads"):
        model_args("gpt2-tiny", n_heads=3)
    with pytest.raises(ConfigError, match="pick n_kv_heads that divides n_heads"):
        model_args("llama-tiny", n_kv_heads=3)
    with pytest.raises(ConfigError, match="no grouped-query attention"):
        model_args("gpt2-tiny", n_kv_heads=2)
    with pytest.raises(ConfigError, match="not ModelArgs fields"):
        model_args("gpt2-tiny", width=3)


def _params(name: str, seed: int) -> dict[str, torch.Tensor]:
    return dict(materialize(build_model(model_args(name)), "cpu", seed).named_parameters())


@pytest.mark.parametrize("name", TINY)
def test_materialize_is_deterministic_and_initialises(name):
    a, b, c = _params(name, 0), _params(name, 0), _params(name, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    args = model_args(name)
    assert a["layers.0.attention_norm.weight"].eq(1).all()
    wq, wo = a["layers.0.attention.wq.weight"], a["layers.0.attention.wo.weight"]
    assert abs(wq.std().item() - 0.02) < 0.003
    assert abs(wo.std().item() - 0.02 / (2 * args.n_layers) ** 0.5) < 0.003
    if args.family == "gpt2":
        assert a["layers.0.attention.wq.bias"].eq(0).all()


@pytest.mark.parametrize("name", TINY)
def test_tied_embeddings_survive_materialize(name):
    for tie in (True, False):
        model = materialize(build_model(model_args(name, tie_embeddings=tie)), "cpu", 0)
        assert (model.output.weight is model.tok_embeddings.weight) == tie


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", TINY)
def test_changing_a_future_token_leaves_earlier_logits(name, backend):
    model = materialize(build_model(model_args(name), backend), "cpu", 0).eval()
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 4096
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert before.shape == (2, 24, 4096) and before.dtype == torch.float32
    torch.testing.assert_close(after[:, :12], before[:, :12], atol=0, rtol=0)
    assert not torch.allclose(after[:, 12:], before[:, 12:])


@pytest.mark.parametrize("name", TINY)
def test_sgd_steps_reduce_the_loss(name):
    torch.manual_seed(0)
    model = materialize(build_model(model_args(name, vocab_size=128)), "cpu", 0)
    ids = torch.randint(0, 128, (4, 33))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(8):
        logits = model(ids[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_dropout_is_active_only_in_training():
    model = materialize(build_model(model_args("gpt2-tiny", dropout=0.5)), "cpu", 0)
    ids = torch.randint(0, 4096, (1, 8))
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_too_long_sequences_are_refused():
    args = dataclasses.replace(MODEL_SHAPES["llama-tiny"], max_seq_len=8)
    model = materialize(build_model(args), "cpu", 0)
    with pytest.raises(ConfigError, match=r"exceeds model\.max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_unknown_attention_backend_fails_at_build():
    with pytest.raises(ConfigError, match=r"attention\.backend='flash' is unknown"):
        build_model(MODEL_SHAPES["gpt2-tiny"], attention_backend="flash")
