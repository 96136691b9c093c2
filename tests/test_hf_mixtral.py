"""Our mixture-of-experts model against transformers' MixtralForCausalLM on the same weights:
import (from_hf), export (to_hf), the MoE shapes Mixtral cannot hold, and training: an
imported Mixtral's loss and router gradients, with transformers' pooled balance loss.

Tolerance: fp32 logits agree to atol 1e-5, rtol 0 (same routing, same fp32 router, the
experts' products summed per token in the same order; attention kernels differ).
"""

import re

import pytest
import torch

from llm.errors import ConfigError
from llm.models import build_model, from_hf, materialize, model_args, to_hf
from llm.models.hf_source import HFSource

V, T = 257, 24
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _config(**kw):
    from transformers import MixtralConfig

    shape = dict(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        router_aux_loss_coef=0.02, dtype=torch.float32,
    )  # fmt: skip
    return MixtralConfig(**(shape | kw))


def _mixtral():
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(_config())


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))


# transformers writes Mixtral's experts one tensor each (block_sparse_moe.experts.{e}.w1, as the
# Hub's checkpoints are) unless told to keep its in-memory layout (mlp.experts.gate_up_proj).
@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused"])
def test_from_hf_matches_transformers_mixtral(original_format, tmp_path):
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    torch.manual_seed(0)
    hf = _mixtral().eval()
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format)
    ours = from_hf(tmp_path / "hf").eval()
    moe = ours.args.moe
    assert (moe.n_experts, moe.top_k, moe.d_expert, moe.router) == (8, 2, 96, "softmax")
    assert moe.norm_topk and moe.aux_loss_coef == 0.02 and ours.args.d_ff == 96
    assert ours.args.rope_theta == 1e4 and not ours.args.tie_embeddings

    # Rows of an expert weight are experts: w3's rows 2..4 are the up half of gate_up_proj's
    # experts 2..4, and reading them reads those experts and nothing else.
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    source, reads = HFSource(tmp_path / "hf"), []
    read = source._read
    source._read = lambda key, index: reads.append((key, index)) or read(key, index)
    w3 = source.rows("layers.1.feed_forward.experts.w3", 2, 5, torch.device("cpu"))
    torch.testing.assert_close(w3, gate_up[2:5, 96:], atol=0, rtol=0)
    if original_format:
        layer = "model.layers.1.block_sparse_moe.experts"
        assert [key for key, _ in reads] == [f"{layer}.{e}.w3.weight" for e in (2, 3, 4)]
    else:
        key = "model.layers.1.mlp.experts.gate_up_proj"
        assert reads == [(key, (slice(2, 5), slice(96, 192)))]
    torch.testing.assert_close(
        ours.layers[1].feed_forward.experts.w1, gate_up[:, :96], atol=0, rtol=0
    )

    with torch.no_grad():
        expected = hf(_ids()).logits
        torch.testing.assert_close(ours(_ids()), expected, atol=ATOL, rtol=0)
        to_hf(ours, tmp_path / "back")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert type(again) is MixtralForCausalLM
        torch.testing.assert_close(again(_ids()).logits, expected, atol=ATOL, rtol=0)


def test_moe_tiny_exports_to_transformers_mixtral(tmp_path):
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    args = model_args("moe-tiny", vocab_size=V)
    ours = materialize(build_model(args), "cpu", seed=3).eval()
    to_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf) is MixtralForCausalLM
    cfg = hf.config
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (8, 2, 96)
    experts = ours.layers[0].feed_forward.experts
    torch.testing.assert_close(
        hf.model.layers[0].mlp.experts.gate_up_proj,
        torch.cat([experts.w1, experts.w3], dim=1),
        atol=0,
        rtol=0,
    )
    with torch.no_grad():
        logits = ours(_ids())
        torch.testing.assert_close(hf(_ids()).logits, logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(from_hf(tmp_path).eval()(_ids()), logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("moe", "why"),
    [
        ({"n_shared_experts": 1}, "n_shared_experts=1: Mixtral has no shared experts"),
        ({"router": "sigmoid"}, "router='sigmoid': Mixtral's router is a softmax"),
        ({"first_dense": 1}, "first_dense=1, every=1: every Mixtral block is a mixture"),
        ({"every": 2}, "first_dense=0, every=2: every Mixtral block is a mixture"),
        ({"capacity_factor": 1.25}, "capacity_factor=1.25: Mixtral drops no tokens"),
        ({"norm_topk": False}, "norm_topk=False: Mixtral renormalises"),
    ],
)
def test_moe_shapes_mixtral_cannot_hold_are_refused(moe, why, tmp_path):
    ours = materialize(build_model(model_args("moe-tiny", vocab_size=V, moe=moe)), "cpu", seed=0)
    with pytest.raises(ConfigError, match="^" + re.escape(f"model.moe.{why}")) as err:
        to_hf(ours, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_mixtral_features_we_cannot_run_are_refused(tmp_path):
    _config(sliding_window=16).save_pretrained(tmp_path / "window")
    with pytest.raises(ConfigError, match=r"sliding-window attention \(sliding_window=16\)"):
        from_hf(tmp_path / "window")
    _config(router_jitter_noise=0.1).save_pretrained(tmp_path / "jitter")
    with pytest.raises(ConfigError, match=r"router_jitter_noise=0\.1"):
        from_hf(tmp_path / "jitter")


def _total_loss(ours, ids):
    """What the Trainer backpropagates for one micro-batch, as a mean over tokens: the
    shifted cross-entropy plus the MoE auxiliary losses (llm.train.moe_stats)."""
    from llm.train.moe_stats import MoEStats

    logits = ours(ids)
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return lm + MoEStats(ours, micro_batches=1).aux_loss()


def test_imported_mixtral_trains_with_transformers_loss_and_router_gradients(tmp_path):
    """An imported Mixtral takes transformers' pooled balance loss with its coefficient: the
    total loss (lm + router_aux_loss_coef x aux) and every router's gradient equal
    MixtralForCausalLM's with labels and output_router_logits=True, on the same batch
    (fp32, 4 layers, top-2 of 8; loss to 1e-6 relative, router gradients to 1e-5 relative
    of their largest entry). No padding: transformers weighs the balance loss's rows by an
    attention_mask when given one, ours counts every row. The per-layer loss, under the same
    coefficient, gives other router gradients."""
    import dataclasses

    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    hf = MixtralForCausalLM(_config(num_hidden_layers=4, router_aux_loss_coef=0.1)).train()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").train()
    assert ours.args.moe.balance_loss == "pooled" and ours.args.moe.aux_loss_coef == 0.1

    ids = _ids()
    out = hf(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    total = _total_loss(ours, ids)
    total.backward()
    assert total.item() == pytest.approx(out.loss.item(), rel=1e-6)
    routers = [(layer.feed_forward.router.gate, hf.model.layers[i].mlp.gate)
               for i, layer in enumerate(ours.layers)]  # fmt: skip
    for mine, theirs in routers:
        scale = theirs.weight.grad.abs().max().item()
        torch.testing.assert_close(mine.weight.grad, theirs.weight.grad, rtol=0, atol=1e-5 * scale)

    per_layer = from_hf(tmp_path / "hf").train()
    moe = dataclasses.replace(per_layer.args.moe, balance_loss="per_layer")
    for layer in per_layer.layers:
        layer.feed_forward.moe = layer.feed_forward.router.moe = moe
    _total_loss(per_layer, ids).backward()
    router = per_layer.layers[0].feed_forward.router.gate.weight.grad
    assert not torch.allclose(router, hf.model.layers[0].mlp.gate.weight.grad, rtol=1e-3)


def test_export_maps_the_balance_loss_to_mixtral_coefficient(caplog):
    """A pooled loss's coefficient is Mixtral's as it is; a per-layer one (summed over 4
    layers, 1 each at perfect balance) is scaled by n_layers / top_k = 2, and the log says so."""
    from llm.models.hf_config import hf_config

    per_layer = model_args("moe-tiny", vocab_size=V, n_layers=4, moe={"aux_loss_coef": 0.01})
    pooled = model_args("moe-tiny", vocab_size=V, moe={"balance_loss": "pooled"})
    with caplog.at_level("INFO", logger="llm.models.hf_config"):
        assert hf_config(pooled).router_aux_loss_coef == 0.01
        assert not caplog.records
        assert hf_config(per_layer).router_aux_loss_coef == pytest.approx(0.02, rel=1e-12)
    assert "aux_loss_coef 0.01 x n_layers 4 / top_k 2 = 0.02" in caplog.text


def test_a_run_importing_mixtral_says_its_balance_loss_is_pooled(tmp_path, caplog):
    """validate() logs it (train.py writes validate's records to the run's train.log)."""
    from helpers import compose_config, small_run_overrides

    from llm.validate import validate

    _mixtral().save_pretrained(tmp_path / "hf")  # router_aux_loss_coef=0.02
    unused = tmp_path / "unused"
    cfg = compose_config(
        small_run_overrides(unused, unused, unused, f"model.init_from={tmp_path / 'hf'}")
    )
    with caplog.at_level("INFO", logger="llm.validate"):
        validate(cfg)
    assert "model.moe.balance_loss=pooled" in caplog.text
    assert "router_aux_loss_coef=0.02" in caplog.text
