"""model.vocab_multiple: the embedding and head padded to a multiple of it, the padded ids
never tokens. A padded model computes what the unpadded one computes (same real rows):
the same loss and gradients, zero gradient on the padded rows, never a padded id sampled,
and an HF export with the tokenizer's vocabulary."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

from llm.errors import ConfigError
from llm.models import MODEL_SHAPES, build_model, materialize, to_hf
from llm.parallel.tensor_parallel import padded_vocab
from llm.train.loss import head_loss
from tests import fused_loss_stand_in

REAL, MULTIPLE = 250, 64  # padded to 256 rows: 6 padded ids
FP32 = 1e-5  # relative (norm of the difference), fp32: the head has 256 columns, not 250


def _pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An unpadded model and a padded one holding the same weights in its real rows (its
    padded rows random, as training would leave them)."""
    args = dataclasses.replace(MODEL_SHAPES[name], vocab_size=REAL)
    plain = materialize(build_model(args), torch.device("cpu"), seed=0)
    padded = materialize(build_model(args.padded(MULTIPLE)), torch.device("cpu"), seed=1)
    state = {}
    for key, value in plain.state_dict().items():
        full = padded.state_dict()[key].clone()
        full[: value.size(0)] = value
        state[key] = full
    padded.load_state_dict(state)
    return plain, padded


def _batch(b: int = 2, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, REAL, (b, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _plain_loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def test_padding_rounds_up_to_the_multiple_and_keeps_the_real_vocabulary():
    args = dataclasses.replace(MODEL_SHAPES["gpt2-tiny"], vocab_size=REAL).padded(MULTIPLE)
    assert (args.vocab_size, args.true_vocab_size, args.real_vocab_size) == (256, 250, 250)
    exact = dataclasses.replace(MODEL_SHAPES["gpt2-tiny"], vocab_size=256).padded(MULTIPLE)
    assert exact.true_vocab_size is None and exact.vocab_size == 256
    assert padded_vocab(REAL, 2, MULTIPLE) == 256 and padded_vocab(REAL, 3, MULTIPLE) == 384


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("fused", ["off", "chunked", "liger", "cce"])
def test_a_padded_model_has_the_loss_and_gradients_of_the_unpadded_one(name, fused, monkeypatch):
    """liger and cce through their stand-ins (tests/fused_loss_stand_in.py): Liger is handed
    the whole padded head, aligned for the GEMMs, with the lowest bias on the padded ids;
    cut-cross-entropy, which takes no bias, the real rows."""
    calls: list = []
    if fused in ("liger", "cce"):
        for module, stand_in in getattr(fused_loss_stand_in, fused)(calls).items():
            monkeypatch.setitem(sys.modules, module, stand_in)
    plain, padded = _pair(name)
    x, y = _batch()
    want = _plain_loss(plain, x, y)
    if fused == "off":
        logits = padded(x)
        assert logits.shape[-1] == 256 and torch.isneginf(logits[..., REAL:]).all()
        got = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    else:
        got = padded(x, head=head_loss(fused, y, chunk=7))
    if fused == "liger":
        assert calls[0]["weight"][0][0] == 256 and calls[0]["bias_lowest_from"] == REAL
    if fused == "cce":
        assert calls[0]["c"][0][0] == REAL
    want.backward()
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=FP32)
    for key, g in _grads(plain).items():
        g_padded = _grads(padded)[key]
        # + 1e-6: a gradient that is zero in exact arithmetic (a key bias) is rounding only.
        assert (g_padded[: g.size(0)] - g).norm() <= FP32 * g.norm() + 1e-6, key
        if key in ("tok_embeddings.weight", "output.weight"):  # padded rows get nothing
            assert not g_padded[REAL:].any(), key


def test_sampling_from_a_padded_model_never_picks_a_padded_id():
    _, padded = _pair("gpt2-tiny")
    with torch.no_grad():
        padded.output.weight[REAL:] = 100.0  # padded rows that would win every draw
        logits = padded(_batch()[0])[:, -1].float()
    drawn = torch.multinomial(F.softmax(logits, dim=-1), 1000, replacement=True)
    assert drawn.max().item() < REAL


def test_hf_export_of_a_padded_model_gives_back_the_true_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM

    plain, padded = _pair("llama-tiny")
    to_hf(padded, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.config.vocab_size == REAL
    x, _ = _batch()
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, plain(x), rtol=1e-4, atol=1e-5)


def test_a_true_vocabulary_not_below_the_rows_is_refused():
    args = MODEL_SHAPES["gpt2-tiny"]
    with pytest.raises(ConfigError, match="true_vocab_size"):
        dataclasses.replace(args, true_vocab_size=args.vocab_size)


def test_a_vocab_multiple_below_one_is_refused():
    from llm.config import ModelConfig

    with pytest.raises(ConfigError, match=r"model\.vocab_multiple=0"):
        ModelConfig(vocab_multiple=0)
