"""Greedy decoding of Hugging Face models (random weights from a config, saved and read back
through llm.inference.load) gives the same tokens as transformers' own ``generate``.

Ours decodes the prompts together through the KV cache (paged and contiguous); transformers
decodes each prompt alone with its DynamicCache, so ragged batching is checked too. Random
weights make many near-ties in the logits, so the prompts run long enough (24 new tokens)
for a wrong cache position or mask to change a token.
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from llm.inference.generate import generate
from llm.inference.load import load_for_inference
from llm.inference.sampling import SamplingParams

V = 257  # the byte tokenizer's vocabulary: load_for_inference needs a tokenizer
NEW = 24


def _gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_greedy_tokens_equal_transformers(tmp_path, make, paged):
    torch.manual_seed(0)
    hf = make().eval()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_for_inference(None, str(tmp_path / "hf"), torch.device("cpu"), tokenizer="byte")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 1)]
    ours = generate(
        loaded.model, prompts, NEW, SamplingParams(temperature=0), None, paged=paged, block_size=4
    )
    with torch.no_grad():
        theirs = [_hf_greedy(hf, p) for p in prompts]
    assert ours.tokens == theirs
