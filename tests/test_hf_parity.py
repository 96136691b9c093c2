"""Our models against transformers' GPT2LMHeadModel / LlamaForCausalLM on the same weights.

Tolerance: fp32 logits agree to atol 1e-6, rtol 0 (we see ~1e-7: same ops, same order,
different kernels for attention).
"""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from llm.errors import ConfigError
from llm.models import build_model, from_hf, materialize, model_args, to_hf

V, T = 96, 24
ATOL = 1e-6


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _llama(**kw) -> LlamaForCausalLM:
    shape = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**(shape | kw)))


def _llama3_rope() -> LlamaForCausalLM:
    # Llama-3.2's rescaled RoPE, tied embeddings and MQA. head_dim 16 and an original context
    # of 256 put the wavelengths (6, 33, 168, 872, ... tokens) in all three bands: kept (< 64),
    # blended (64..256) and divided by the factor (> 256).
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    }  # fmt: skip
    return _llama(
        hidden_size=64, rope_parameters=rope, tie_word_embeddings=True, num_key_value_heads=1
    )


HF_MODELS = {"gpt2": _gpt2, "llama-gqa": _llama, "llama3-rope": _llama3_rope}


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", sorted(HF_MODELS))
def test_from_hf_matches_transformers_and_to_hf_round_trips(kind, backend, tmp_path):
    torch.manual_seed(0)
    hf = HF_MODELS[kind]().eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids()
    ours = from_hf(tmp_path / "hf", attention_backend=backend).eval()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=ATOL, rtol=0)
        to_hf(ours, tmp_path / "back")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(again) is type(hf)
        torch.testing.assert_close(again(ids).logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_our_init_exports_to_transformers(name, tmp_path):
    ours = materialize(build_model(model_args(name, vocab_size=V)), "cpu", seed=3).eval()
    to_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reloaded = from_hf(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(_ids()).logits, ours(_ids()), atol=ATOL, rtol=0)
        torch.testing.assert_close(reloaded(_ids()), ours(_ids()), atol=0, rtol=0)


def test_bf16_load_keeps_the_dtype(tmp_path):
    _llama().save_pretrained(tmp_path)
    ours = from_hf(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours(_ids()).dtype == torch.bfloat16


def test_bad_directories_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        from_hf(tmp_path / "missing")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        from_hf(tmp_path / "garbled")
    _gpt2().config.save_pretrained(tmp_path / "no_weights")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        from_hf(tmp_path / "no_weights")
    _gpt2().save_pretrained(tmp_path / "garbled_weights")
    (tmp_path / "garbled_weights" / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ConfigError, match="cannot be loaded"):
        from_hf(tmp_path / "garbled_weights")
    _gpt2().save_pretrained(tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lacks weights \['transformer.h.0.mlp.c_fc.weight'\]"):
        from_hf(tmp_path / "partial")
    BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match="'bert' checkpoint; from_hf loads gpt2 and llama"):
        from_hf(tmp_path / "bert")
