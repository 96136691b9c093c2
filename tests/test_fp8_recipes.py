"""fp8 training recipes in emulation (llm/precision/fp8): the quantisers against hand-computed
codes and scales, Fp8Linear's three GEMMs against a reference written here (bitwise: the
same fp32 operands through the same matmuls) and against torchao's own emulated Float8Linear,
the conversion of a model, and a few AdamW steps of a tiny llama with each recipe on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm.errors import ConfigError
from llm.models.build import build_model, materialize
from llm.models.layers import RMSNorm
from llm.models.shapes import model_args
from llm.precision.fp8 import (
    DEEPSEEK_RULE,
    E4M3,
    E5M2,
    RECIPES,
    TORCHAO_POW2_RULE,
    TORCHAO_RULE,
    Fp8Linear,
    Fp8Stats,
    convert_to_fp8,
    overflow_threshold,
    quantize_blocks,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tiles,
    quantize_with_factor,
    record_fp8_stats,
)
from llm.precision.fp8.linear import plain_name

# d_model, n_kv_heads * head_dim and d_ff multiples of 128, as deepseek's tiles need.
ARGS = dict(d_model=128, n_heads=4, n_kv_heads=4, d_ff=384)


# ---- the quantisers, by hand ------------------------------------------------------------


def test_tiles_give_each_128_their_own_scale_and_exact_codes():
    """Tile 0's amax is 56, so s = 56/448 = 1/8; tile 1's is 7, s = 1/64 (both exact in
    fp32). Codes are x / s rounded to e4m3 (3 mantissa bits, ties to even)."""
    x = torch.zeros(1, 256)
    x[0, :6] = torch.tensor([56.0, -28.0, 1.0, 0.3, 0.296875, 0.265625])
    x[0, 128:131] = torch.tensor([7.0, -3.5, 0.001])
    q = quantize_tiles(x, dim=1)
    assert q.scale.tolist() == [[1 / 8, 1 / 64]]
    # 0.3*8 = 2.4 -> 2.5 (steps of 0.25 in [2, 4)); 2.375 ties to 2.5 (even mantissa),
    # 2.125 ties to 2.0; 0.001*64 = 0.064 -> 0.0625 (steps of 2^-7 in [2^-4, 2^-3)).
    assert q.data[0, :6].float().tolist() == [448.0, -224.0, 8.0, 2.5, 2.5, 2.0]
    assert q.data[0, 128:131].float().tolist() == [448.0, -224.0, 0.0625]
    assert q.dequantize()[0, 128:131].tolist() == [7.0, -3.5, 0.0625 / 64]
    assert q.saturated.item() == 0


def test_a_zero_tile_gets_a_finite_scale_and_zero_codes():
    x = torch.zeros(2, 128)
    x[1, 0] = 1.0
    for q in (quantize_tiles(x, dim=1), quantize_rowwise(x, dim=1), quantize_tensorwise(x)):
        assert torch.isfinite(q.scale).all()
        assert torch.equal(q.dequantize()[0], torch.zeros(128))
    # DeepSeek's kernel floors the amax at 1e-4; torchao's at 1e-12.
    assert quantize_tiles(x, dim=1).scale[0, 0].item() == pytest.approx(1e-4 / 448, rel=1e-6)


def test_an_outlier_changes_only_its_own_tile():
    """The point of fine-grained scaling: an outlier coarsens its 128 values, not the row."""
    torch.manual_seed(0)
    x = torch.randn(4, 256)
    spiked = x.clone()
    spiked[2, 5] = 1e5  # 1e5 times the rest: they fall to e4m3 subnormals under one scale
    before, after = quantize_tiles(x, dim=1), quantize_tiles(spiked, dim=1)
    assert after.scale[2, 0] > 1e4 * before.scale[2, 0]
    assert torch.equal(after.scale[:, 1], before.scale[:, 1])
    assert torch.equal(after.data[:, 128:].float(), before.data[:, 128:].float())
    assert torch.equal(after.data[[0, 1, 3]].float(), before.data[[0, 1, 3]].float())
    # One scale per tensor: every value is coarsened, the far tile too.
    coarse = quantize_tensorwise(spiked)
    err = (coarse.dequantize() - spiked)[:, 128:].norm() / spiked[:, 128:].norm()
    assert err > 3 * (after.dequantize() - spiked)[:, 128:].norm() / spiked[:, 128:].norm()


def test_values_past_the_maximum_saturate_never_inf():
    """With a given scale (delayed scaling's), values past 448 * s clamp to 448; those a
    plain cast would make inf or NaN (|x/s| >= 464, half an e4m3 ulp past 448) are counted."""
    assert overflow_threshold(E4M3) == 464.0 and overflow_threshold(E5M2) == 61440.0
    x = torch.tensor([[1.0, 450.0, 1000.0, -1e6, float("inf"), -448.0, 463.0, 464.0]])
    q = quantize_with_factor(x, torch.ones(1, 1), (1, 8), DEEPSEEK_RULE, E4M3)
    assert q.data.float().tolist() == [[1.0, 448.0, 448.0, -448.0, 448.0, -448.0, 448.0, 448.0]]
    assert q.saturated.item() == 4  # 1000, -1e6, inf, 464
    # e5m2 (tensorwise's gradients): max 57344; a plain cast makes 61440 and above inf.
    g = torch.tensor([[1.0, 57344.0, 60000.0, 61440.0, 1e6, -float("inf")]])
    q = quantize_with_factor(g, torch.ones(1, 1), (1, 6), TORCHAO_RULE, E5M2)
    assert q.data.float().tolist() == [[1.0, 57344.0, 57344.0, 57344.0, 57344.0, -57344.0]]
    assert q.saturated.item() == 3
    # A scale from the tensor's own amax never saturates, whatever the magnitudes.
    assert quantize_tiles(torch.randn(3, 128) * 1e30, dim=1).saturated.item() == 0


def test_e4m3_rounding_is_torchs_cast():
    """Every finite e4m3 code round-trips, and values between codes (midpoints included)
    land where torch's own cast puts them."""
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    codes = codes[torch.isfinite(codes)]
    one = torch.ones(1, 1)
    q = quantize_with_factor(codes.view(1, -1), one, (1, codes.numel()), DEEPSEEK_RULE, E4M3)
    assert torch.equal(q.data.float().flatten(), codes)
    ordered = codes.unique()
    mids = (ordered[1:] + ordered[:-1]) / 2
    between = torch.cat([mids, mids * 1.01, mids * 0.99]).view(1, -1)
    q = quantize_with_factor(between, one, (1, between.numel()), DEEPSEEK_RULE, E4M3)
    assert torch.equal(q.data.float(), between.to(E4M3).float())


def test_blocks_are_128_by_128():
    w = torch.zeros(256, 128)
    w[:128, 0], w[5, 7] = 7.0, -0.5  # block 0: amax 7, s = 1/64
    w[200, 100] = 3.5  # block 1: amax 3.5, s = 1/128
    q = quantize_blocks(w)
    assert q.scale.shape == (2, 1) and q.scale.flatten().tolist() == [1 / 64, 1 / 128]
    assert (q.data[5, 7].item(), q.data[200, 100].item()) == (-32.0, 448.0)
    assert torch.equal(q.dequantize(), w)


def test_tensorwise_and_rowwise_by_hand():
    """torchao's arithmetic: r = 448 / amax, codes = x * r, x = codes / r; its rowwise
    rounds r down to a power of two."""
    x = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    t = quantize_tensorwise(x)
    assert t.factor.item() == 112.0 and t.data.float().tolist() == [[112.0, -224.0], [448.0, 56.0]]
    rows = quantize_rowwise(x, dim=1)  # amax 2 and 4: r = 224 -> 128, 112 -> 64
    assert rows.rule == TORCHAO_POW2_RULE and t.rule == TORCHAO_RULE
    assert rows.factor.flatten().tolist() == [128.0, 64.0]
    assert rows.data.float().tolist() == [[128.0, -256.0], [256.0, 32.0]]
    cols = quantize_rowwise(x, dim=0)  # amax 4 and 2, over the rows
    assert cols.factor.flatten().tolist() == [64.0, 128.0]
    for q in (t, rows, cols):
        assert torch.equal(q.dequantize(), x)
    assert quantize_rowwise(x, dim=1, rule=TORCHAO_RULE).factor.flatten().tolist() == [224.0, 112.0]


def test_tiles_refuse_a_dimension_not_a_multiple_of_128():
    with pytest.raises(ConfigError, match=r"shape \(4, 200\).*multiple of 128") as info:
        quantize_tiles(torch.zeros(4, 200), dim=1)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="multiple of 128"):
        quantize_blocks(torch.zeros(128, 64))


# ---- Fp8Linear against a reference written here -----------------------------------------


def _tiles(t, dim):
    """DeepSeek's act_quant by hand, 128 at a time along ``dim``, fp32 dequantised."""
    out = torch.empty_like(t)
    for i in range(0, t.size(dim), 128):
        chunk = t.narrow(dim, i, 128)
        s = chunk.abs().amax(dim=dim, keepdim=True).clamp(min=1e-4) / 448
        out.narrow(dim, i, 128).copy_((chunk / s).clamp(-448, 448).to(E4M3).float() * s)
    return out


def _blocks(w):
    out = torch.empty_like(w)
    for i in range(0, w.size(0), 128):
        for j in range(0, w.size(1), 128):
            b = w[i : i + 128, j : j + 128]
            s = b.abs().max().clamp(min=1e-4) / 448
            out[i : i + 128, j : j + 128] = (b / s).clamp(-448, 448).to(E4M3).float() * s
    return out


def _torchao(t, dim, dtype, pow2):
    """torchao's cast: amax over ``dim`` (None: all), r in float64, multiply, divide back."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    r = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        r = torch.exp2(torch.floor(torch.log2(r)))
    return (t * r).clamp(-fmax, fmax).to(dtype).float() / r


def _padded(t, fn):
    m = t.size(0)
    return fn(F.pad(t, (0, 0, 0, -m % 128)))[:m]


def _reference(recipe, x, w, dy):
    """(out, grad_x, grad_w) of x (M, K) @ w (N, K)^T, each GEMM on the recipe's operands."""
    if recipe == "deepseek":
        x_hat, w_hat = _tiles(x, 1), _blocks(w)
        grad_x = _tiles(dy, 1) @ w_hat
        grad_w = _padded(dy, lambda t: _tiles(t, 0)).t() @ _padded(x_hat, lambda t: _tiles(t, 0))
        return F.linear(x_hat, w_hat), grad_x, grad_w
    pow2 = recipe == "rowwise"
    row = None if recipe == "tensorwise" else 1
    col = None if recipe == "tensorwise" else 0
    g = E5M2 if recipe == "tensorwise" else E4M3
    out = F.linear(_torchao(x, row, E4M3, pow2), _torchao(w, row, E4M3, pow2))
    grad_x = _torchao(dy, row, g, pow2) @ _torchao(w, col, E4M3, pow2)
    grad_w = _torchao(dy, col, g, pow2).t() @ _torchao(x, col, E4M3, pow2)
    return out, grad_x, grad_w


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_linear_matches_the_reference_bitwise(recipe):
    """Forward and both gradients equal to the bit; 200 tokens, so deepseek's 128x1 tiles
    of grad_weight end in a padded tile. The bias is added in fp32 after the GEMM."""
    torch.manual_seed(1)
    lin = nn.Linear(256, 128)
    fp8 = Fp8Linear.from_linear(lin, recipe)
    x = torch.randn(2, 100, 256).requires_grad_()
    dy = torch.randn(2, 100, 128)
    out = fp8(x)
    out.backward(dy)
    x2, dy2 = x.detach().reshape(200, 256), dy.reshape(200, 128)
    ref_out, ref_gx, ref_gw = _reference(recipe, x2, lin.weight.detach(), dy2)
    assert torch.equal(out.reshape(200, 128), ref_out + lin.bias.detach())
    assert torch.equal(x.grad.reshape(200, 256), ref_gx)
    assert torch.equal(lin.weight.grad, ref_gw)
    assert torch.equal(lin.bias.grad, dy2.sum(0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_torchaos_float8_linear(recipe):
    """torchao's own Float8Linear, emulated on CPU: same codes, same scales, same GEMMs."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    torch.manual_seed(2)
    lin = nn.Linear(256, 128, bias=False)
    theirs = Float8Linear.from_float(nn.Linear(256, 128, bias=False), config=config)
    theirs.weight = nn.Parameter(lin.weight.detach().clone())
    ours = Fp8Linear.from_linear(lin, recipe)
    x, dy = torch.randn(64, 256), torch.randn(64, 128)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, out2 = theirs(x1), ours(x2)
    out1.backward(dy)
    out2.backward(dy)
    assert torch.equal(out1, out2)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(theirs.weight.grad, lin.weight.grad)


def test_fine_grained_scales_lose_less_to_an_outlier_tile():
    """Against the unquantised fp32 linear: every recipe close, and with one outlier in the
    input, one scale per tensor loses far more than DeepSeek's tiles (the paper's motivation)."""
    torch.manual_seed(3)
    lin = nn.Linear(256, 128, bias=False)
    x = torch.randn(128, 256)
    spiked = x.clone()
    spiked[7, 3] = 1e5
    errors = {}
    for recipe in RECIPES:
        fp8 = Fp8Linear.from_linear(lin, recipe)
        with torch.no_grad():
            plain = (fp8(x) - lin(x)).norm() / lin(x).norm()
            diff = fp8(spiked) - lin(spiked)
            keep = torch.arange(128) != 7  # the rows without the outlier
            errors[recipe] = diff[keep].norm() / lin(spiked)[keep].norm()
        assert plain < 0.05
    assert errors["deepseek"] < 0.05
    assert errors["tensorwise"] > 3 * errors["deepseek"]


def test_stats_record_every_operand_only_when_asked():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(256, 128))
    convert = Fp8Linear.from_linear(model[0], "deepseek")
    model[0] = convert
    x = torch.randn(130, 256, requires_grad=True)
    model(x).sum().backward()
    assert convert.stats is None
    with record_fp8_stats(model) as stats:
        model(x).square().sum().backward()
    assert convert.stats is None
    summary = stats.summary()
    # deepseek reuses the forward weight blocks for grad_input: no weight_t cast.
    assert set(summary) == {"input", "weight", "grad_output", "grad_output_t", "input_t"}
    assert {s["kind"] for s in summary.values()} == {"activation", "weight", "gradient"}
    for s in summary.values():
        assert s["calls"] == 1 and 0 < s["mean_rel_error"] < 0.1 and s["saturated"] == 0


def test_autocast_gives_the_autocast_dtype_and_fp32_weight_grads():
    torch.manual_seed(5)
    lin = nn.Linear(128, 128)
    fp8 = Fp8Linear.from_linear(lin, "deepseek")
    x = torch.randn(4, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# ---- conversion and training ------------------------------------------------------------


def test_convert_keeps_parameters_and_leaves_the_rest_high_precision():
    model = build_model(model_args("llama-tiny", **ARGS))  # meta device: no weights yet
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert convert_to_fp8(model, "deepseek") is model
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 7 * model.args.n_layers
    assert {n.rsplit(".", 1)[1] for n in fp8} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    assert isinstance(model.norm, RMSNorm)


def test_convert_leaves_the_router_and_routed_experts_alone():
    model = convert_to_fp8(build_model(model_args("moe-tiny")), "rowwise")
    moe = model.layers[0].feed_forward
    assert type(moe.router.gate) is nn.Linear
    assert not any(isinstance(m, Fp8Linear) for m in moe.experts.modules())
    assert isinstance(model.layers[0].attention.wk, Fp8Linear)


def test_convert_refuses_an_unknown_recipe_and_untileable_shapes():
    with pytest.raises(ConfigError, match="fp8_recipe='mxfp8' is unknown"):
        convert_to_fp8(build_model(model_args("llama-tiny", **ARGS)), "mxfp8")
    gqa = build_model(model_args("llama-tiny", d_model=128, n_heads=4, n_kv_heads=2, d_ff=384))
    with pytest.raises(
        ConfigError,
        match=r"layers\.0\.attention\.wk has in_features=128, "
        r"out_features=64",
    ) as info:
        convert_to_fp8(gqa, "deepseek")
    assert "\n" not in str(info.value) and "multiples of 128" in str(info.value)
    assert not any(isinstance(m, Fp8Linear) for m in gqa.modules())  # refused before any swap


def _losses(recipe, steps=8):
    torch.manual_seed(0)
    args = model_args("llama-tiny", **ARGS)
    ids = torch.randint(0, args.vocab_size, (2, 65))  # 128 tokens a step
    model = build_model(args)
    if recipe is not None:
        convert_to_fp8(model, recipe)
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_each_recipe_trains_like_fp32():
    """A tiny llama memorising one batch: the loss falls with every recipe and stays within
    3% of fp32's at every step."""
    reference = _losses(None)
    for recipe in RECIPES:
        losses = _losses(recipe)
        assert losses[-1] < 0.7 * losses[0], recipe
        for ours, theirs in zip(losses, reference, strict=True):
            assert abs(ours - theirs) < 0.03 * theirs, (recipe, losses, reference)


def test_stats_add_up_per_layer_and_count_underflow():
    """A value below the smallest e4m3 code at its tile's scale is cast to zero: counted as
    underflowed (nonzero in, zero out); a second recording adds to the same layer's row."""
    model = nn.Sequential(Fp8Linear(128, 128, bias=False, recipe="deepseek"))
    x = torch.zeros(1, 128)
    x[0, :3] = torch.tensor([448.0, 1e-6, 0.25])  # scale 1: 1e-6 is under 2^-10, 0.25 a code
    stats = Fp8Stats()
    for _ in range(2):
        with torch.no_grad(), record_fp8_stats(model, stats):
            model(x)
    row = stats.by_layer()["0"]["input"]
    assert (row["calls"], row["underflowed"], row["saturated"]) == (2, 2, 0)
    assert row["underflowed_fraction"] == 2 / 256
    assert stats.summary()["input"]["underflowed"] == 2  # the same, over layers


def test_layer_names_leave_wrappers_out():
    name = "module._orig_mod.layers.0._checkpoint_wrapped_module.attention.wq"
    assert plain_name(name) == "layers.0.attention.wq"
