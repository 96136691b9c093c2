"""The activation formula under precision=fp8 (llm/estimate/fp8_terms.py) against what
autograd saves, per recipe: tensorwise and rowwise keep the 16-bit input and the fp32 weight
itself; deepseek keeps fp8 codes with their scales, of every linear's input and weight.
Measured as tests/test_activation_formula.py does (saved-tensor hooks, one count per
storage, parameters left out); equality is exact."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config
from test_activation_formula import ActivationsOnly

from llm.config import RecomputeConfig
from llm.errors import ConfigError
from llm.estimate import layer_terms
from llm.estimate.estimator import estimate_policy
from llm.estimate.startup import announce_estimate
from llm.models import Block, model_args
from llm.precision import apply_precision, resolve_precision
from llm.recompute import apply_recompute

CPU = torch.device("cpu")
B, S = 2, 16
# Every in/out feature a multiple of 128, as deepseek's blocks need.
SHAPES = {
    "llama-tiny": dict(d_model=128, n_kv_heads=4, d_ff=384),
    "gpt2-tiny": dict(d_model=128, d_ff=512),
}


def _measure(family, recipe, backend, dropout, recompute, shape=None):
    args = model_args(family, dropout=dropout, **(SHAPES[family] if shape is None else shape))
    policy = resolve_precision("fp8", CPU, fp8_recipe=recipe)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(args, backend, "auto")])
    apply_precision(model, policy)  # the block's linears become Fp8Linear
    every_other = recompute == "op_sac_every_other_mm"
    name = "op_sac" if every_other else recompute
    apply_recompute(model, RecomputeConfig(name=name, save_every_other_mm=every_other))
    block = model.layers[0].train()
    x = torch.randn(B, S, args.d_model, requires_grad=True)
    with ActivationsOnly(block) as counter, policy.autocast(CPU):
        block(x).sum().backward()
    return counter.bytes, layer_terms(args, B, S, policy, backend=backend, recompute=recompute)


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "deepseek"])
# eager; sdpa's flash kernel (its output kept, which wo reads); sdpa with dropout (math).
@pytest.mark.parametrize("backend,dropout", [("eager", 0.0), ("sdpa", 0.0), ("sdpa", 0.1)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_formula_equals_measured_block(family, recipe, backend, dropout, recompute):
    measured, formula = _measure(family, recipe, backend, dropout, recompute)
    assert measured == sum(formula.values()), formula


def test_deepseek_keeps_fp8_copies_where_tensorwise_keeps_16_bit_inputs():
    """Per term: deepseek's linear inputs at 1 + 4/128 bytes an element where tensorwise
    keeps 2, and a 1-byte weight copy (with block scales) that tensorwise does not make."""
    args = model_args("llama-tiny", **SHAPES["llama-tiny"])
    tw, ds = (
        layer_terms(args, B, S, resolve_precision("fp8", CPU, fp8_recipe=r), backend="eager")
        for r in ("tensorwise", "deepseek")
    )
    n = B * S * args.d_model
    assert (tw["mlp.input"], ds["mlp.input"]) == (2 * n * 2, 2 * (n + n // 128 * 4))
    assert "wo.input" not in ds and ds["wo.input_fp8"] == n + n // 128 * 4
    assert "fp8.weight_copies" not in tw and "autocast.weight_copies" not in tw
    weights = 4 * 128 * 128 + 3 * 128 * 384
    assert ds["fp8.weight_copies"] == weights + (4 + 3 * 3) * 4  # 13 blocks of 128x128


@pytest.mark.parametrize("recipe", ["tensorwise", "deepseek"])
@pytest.mark.parametrize("recompute", ["op_sac", "op_sac_every_other_mm"])
def test_op_sac_keeps_the_fp8_gemms_fp32_outputs(recipe, recompute):
    measured, formula = _measure("llama-tiny", recipe, "sdpa", 0.0, recompute)
    assert measured == sum(formula.values()), formula


# moe-tiny's widths (64, kv 32, experts 96) are multiples of 16, not of 128: deepseek gets a
# 128-wide MoE block with one shared expert (converted), beside the router and routed experts
# (kept in bf16).
MOE_128 = dict(
    d_model=128, n_kv_heads=4, moe=dict(n_experts=8, top_k=2, d_expert=128, n_shared_experts=1)
)


@pytest.mark.parametrize(
    "recipe,shape", [("tensorwise", {}), ("tensorwise", MOE_128), ("deepseek", MOE_128)]
)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_moe_blocks_convert_attention_and_shared_experts_only(recipe, shape, recompute):
    measured, formula = _measure("moe-tiny", recipe, "eager", 0.0, recompute, shape)
    assert measured == sum(formula.values()), formula
    assert formula["autocast.weight_copies"] > 0  # the router's and routed experts' copies


def test_the_formula_refuses_tensor_parallel_fp8():
    policy = resolve_precision("fp8", CPU, fp8_recipe="deepseek")
    args = model_args("llama-tiny", **SHAPES["llama-tiny"])
    with pytest.raises(ConfigError, match="one tensor-parallel rank"):
        layer_terms(args, B, S, policy, tp=2)


def test_the_estimate_takes_the_runs_recipe_on_either_device():
    for device in ("cpu", "cuda"):
        policy = estimate_policy("fp8", device, "deepseek")
        assert policy.fp8 and policy.fp8_recipe == "deepseek"


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=moe-tiny", "precision=fp8"],
        ["precision=fp8_deepseek", "recompute=op_sac"],
        ["precision=fp8_rowwise", "recompute=selective"],
    ],
)
def test_the_estimate_a_run_prints_at_start_takes_fp8(overrides, tmp_path, capsys):
    """train.py prints the estimate before every run: an fp8 run of any supported shape and
    recompute policy gets one (a refusal there would stop a run that can train)."""
    cfg = compose_config([f"output_dir={tmp_path}", "train.device=cpu", *overrides])
    announce_estimate(cfg, 1)
    assert capsys.readouterr().out.startswith("estimate per rank:")
