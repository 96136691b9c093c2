"""INT4 weight-only quantisation (llm/inference/quantize.py, awq.py): the group quantiser on
hand-computed groups, packing, QuantizedLinear against F.linear, the exact equivalence of
AWQ's scaling, AWQ against RTN, the refusals, torch's CPU int4 kernel, and torchao's INT4
weight-only quantisation as a peer (CPU: its prototype config; CUDA: Int4WeightOnlyConfig)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm.data.dataset import Batch
from llm.errors import ConfigError
from llm.inference.awq import ScaleGroup, awq_scale, search_scale
from llm.inference.quantize import (
    QuantizedLinear,
    block_linears,
    dequantize_groups,
    fake_quantize,
    pack_int4,
    quantize_groups,
    quantize_model,
    token_loss,
    torchao_int4,
    unpack_int4,
)
from llm.models import build_model, materialize, model_args


def _model(name: str, seed: int = 0, **overrides):
    return materialize(build_model(model_args(name, **overrides)), "cpu", seed=seed).eval()


def _ids(n: int, t: int, vocab: int = 4096, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_a_group_with_known_min_and_max_gives_exact_codes_and_values():
    # Row 0: min -1, max 2 -> scale 3/15 = 0.2, zero point round(1 / 0.2) = 5.
    # Row 1: min -0.45, max 0.3 -> scale 0.05, zero point 9.
    w = torch.tensor([[-1.0, 2.0, 0.62, 1.13], [0.0, -0.45, 0.3, -0.15]])
    codes, scales, zeros = quantize_groups(w, group_size=4)
    assert codes.tolist() == [[0, 15, 8, 11], [9, 0, 15, 6]]  # 0.62/0.2 = 3.1 -> 3 + 5
    assert zeros.tolist() == [[5], [9]]
    torch.testing.assert_close(scales, torch.tensor([[0.2], [0.05]]))
    expected = torch.tensor([[-1.0, 2.0, 0.6, 1.2], [0.0, -0.45, 0.3, -0.15]])
    torch.testing.assert_close(dequantize_groups(codes, scales, zeros), expected)


def test_a_mixed_sign_group_is_quantised_as_llm_awq_does():
    """llm-awq's pseudo_quantize_tensor (zero_point=True), written out: the same values."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    groups = w.reshape(-1, 128)
    hi, lo = groups.amax(1, keepdim=True), groups.amin(1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-5) / 15
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    awq = ((torch.clamp(torch.round(groups / scales) + zeros, 0, 15) - zeros) * scales).reshape(
        8, 256
    )
    torch.testing.assert_close(fake_quantize(w, 128), awq, rtol=0, atol=0)


def test_an_all_zero_group_and_constant_groups_come_back_exactly():
    w = torch.tensor([[0.0] * 4, [0.5] * 4, [-0.3] * 4])
    codes, scales, zeros = quantize_groups(w, group_size=4)
    assert codes[:, 0].tolist() == [0, 15, 0] and zeros[:, 0].tolist() == [0, 0, 15]
    torch.testing.assert_close(dequantize_groups(codes, scales, zeros), w)


def test_pack_and_unpack_round_trip_every_pair_of_codes():
    pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)  # (256, 2)
    codes = pairs.reshape(1, 512)
    packed = pack_int4(codes)
    assert packed.shape == (1, 256) and packed.dtype == torch.uint8
    assert packed[0, :3].tolist() == [0x00, 0x01, 0x02] and packed[0, 16].item() == 0x10
    assert sorted(packed[0].tolist()) == list(range(256))  # every byte once
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("divisor", [False, True])
def test_quantized_linear_equals_f_linear_with_the_dequantised_weight(divisor):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 48)
    s = torch.rand(256, generator=g) + 0.5 if divisor else None
    q = QuantizedLinear.from_linear(linear, 128, s)
    x = torch.randn(3, 5, 256, generator=g)
    w = dequantize_groups(*quantize_groups(linear.weight, 128))
    expected = F.linear(x / s if divisor else x, w, linear.bias)
    torch.testing.assert_close(q(x), expected)
    assert q.packed.shape == (48, 128) and q.scales.shape == (48, 2)


def test_torchs_cpu_int4_kernel_matches_the_dequantised_path():
    linear = nn.Linear(256, 64)
    q = QuantizedLinear.from_linear(linear, 128, torch.rand(256) + 0.5)
    x = torch.randn(4, 256)
    reference = q(x)
    q.use_kernel(torch.float32)
    torch.testing.assert_close(q(x), reference, rtol=1e-4, atol=1e-4)


def _divide_inputs(model: nn.Module, divisors: dict) -> None:
    """What QuantizedLinear does with an input divisor, on a float linear."""
    for name, s in divisors.items():
        model.get_submodule(name).register_forward_pre_hook(lambda _m, args, s=s: (args[0] / s,))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_folding_the_scales_without_quantising_leaves_the_logits_unchanged(name):
    model = _model(name)
    with torch.no_grad():  # norms that are not the identity, so folding into them shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    ids = _ids(4, 32, model.args.vocab_size)
    before = model(ids)
    folded = copy.deepcopy(model)
    record = awq_scale(folded, ids, quantize_weight=lambda w: w, grid=(0.5,))
    norm = folded.layers[0].attention_norm.weight
    assert not torch.allclose(norm, model.layers[0].attention_norm.weight)  # 1/s went in
    assert set(record.divisors) == {
        f"layers.{i}.{n}" for i in range(2) for n in ("attention.wo", "feed_forward.w2")
    }
    _divide_inputs(folded, record.divisors)
    torch.testing.assert_close(folded(ids), before, rtol=1e-5, atol=1e-5)


def test_awq_with_alpha_zero_is_rtn():
    model, ids = _model("gpt2-mini"), _ids(4, 64)
    rtn, awq = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, "rtn")
    record = quantize_model(awq, "awq", calibration=ids, awq_grid=(0.0,))
    assert set(record.alphas.values()) == {0.0}
    torch.testing.assert_close(awq(ids), rtn(ids), rtol=0, atol=0)


def test_on_a_layer_with_outlier_input_channels_awq_beats_rtn():
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    x = torch.randn(8, 32, 256, generator=g)
    x[..., :4] *= 30  # four salient channels, as LLMs' activation outliers
    group = ScaleGroup("fc", None, {"fc": linear}, linear)
    with torch.no_grad():
        alpha, _s, error, rtn_error = search_scale(
            group, x, fake_quantize, tuple(i / 20 for i in range(20))
        )
    assert alpha > 0 and error < 0.8 * rtn_error


def test_a_whole_model_with_outlier_channels_loses_less_under_awq_than_under_rtn():
    """gpt2-mini with four channels of every norm's gain 20x (the activation outliers of
    trained LLMs; a fresh init has none, and there AWQ and RTN tie within noise), scored on
    its calibration tokens labelled by its own unquantised greedy predictions."""
    model, ids = _model("gpt2-mini"), _ids(16, 128)
    with torch.no_grad():
        for block in model.layers:
            for norm in (block.attention_norm, block.ffn_norm):
                norm.weight[:4] *= 20
        batches = [Batch(ids, model(ids).argmax(-1))]
    losses = {"unquantised": token_loss(model, batches)}
    for method in ("rtn", "awq"):
        quantized = copy.deepcopy(model)
        quantize_model(quantized, method, calibration=ids)
        assert isinstance(quantized.layers[3].feed_forward.w2, QuantizedLinear)
        assert isinstance(quantized.output, nn.Linear)  # the head stays
        losses[method] = token_loss(quantized, batches)
    assert losses["unquantised"] < losses["awq"] < losses["rtn"]


def test_the_refusals_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="in_features=64, not a multiple of group_size=128"):
        quantize_model(_model("gpt2-tiny"), "rtn")
    with pytest.raises(ConfigError, match="method 'gptq' is unknown"):
        quantize_model(_model("gpt2-mini"), "gptq")
    with pytest.raises(ConfigError, match="AWQ needs calibration data"):
        quantize_model(_model("gpt2-mini"), "awq")
    with pytest.raises(ConfigError, match="dense models"):
        block_linears(build_model(model_args("moe-tiny")))


def _dequantised(linear: nn.Module, k: int) -> torch.Tensor:
    """The weight (N, K) a linear computes with: its outputs for the identity's rows."""
    with torch.no_grad():
        return linear(torch.eye(k)).T


def test_torchao_int4_on_cpu_is_our_rtn_up_to_its_float_zero_point():
    """torchao's CPU int4 (the prototype config: Int4WeightOnlyConfig does not run on a CPU)
    chooses scale (max - min) / 15 as we do, but a float zero point (min and max exact, no
    integer rounding of the offset), so a weight may land one step from ours; each is
    within half a step of the fp32 weight."""
    model = _model("gpt2-mini")
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(ours, "rtn")
    assert torchao_int4(theirs) == "PrototypeInt4WeightOnlyConfig"
    w = model.layers[0].feed_forward.w1.weight.detach()  # (512, 128)
    step = (w.amax(1) - w.amin(1))[:, None] / 15
    w_ours = ours.layers[0].feed_forward.w1.weight()
    fc = theirs.layers[0].feed_forward.w1
    w_theirs = _dequantised(fc, 128) - fc.bias[:, None]
    assert ((w_ours - w).abs() <= step / 2 + 1e-6).all()
    assert ((w_theirs - w).abs() <= step / 2 + 1e-4).all()
    assert ((w_ours - w_theirs).abs() <= step + 1e-4).all()
    assert (w_ours != w_theirs).any()  # the zero points do differ
    ids = _ids(4, 64)
    reference = model(ids)
    err_ours, err_theirs = ((m(ids) - reference).norm() / reference.norm() for m in (ours, theirs))
    assert err_theirs < 2 * err_ours and err_ours < 2 * err_theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_int4_kernel_and_torchaos_config_match_our_rtn():
    """The kernel computes our dequantised weight's product (bf16 rounding apart); torchao's
    Int4WeightOnlyConfig (tinygemm, float zero point) lands as far from the bf16 product as
    our RTN does (its codes differ from ours by up to one step, so not closer than that)."""
    linear = nn.Linear(2048, 512, bias=False).cuda().to(torch.bfloat16)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense = linear(x).float()
        q = QuantizedLinear.from_linear(linear, 128)
        reference = q(x).float()
        q.use_kernel(torch.bfloat16)
        kernel_error = ((q(x).float() - reference).norm() / reference.norm()).item()
        assert kernel_error < 1e-2, f"kernel against dequantised: {kernel_error:.3g}"
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        theirs = nn.Sequential(copy.deepcopy(linear))
        config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        quantize_(theirs, config)
        ours_error = ((reference - dense).norm() / dense.norm()).item()
        their_error = ((theirs(x).float() - dense).norm() / dense.norm()).item()
    assert their_error < 2 * ours_error and ours_error < 2 * their_error, (ours_error, their_error)
