"""Precision policies: the dtype table, mixed-precision runs tracking fp32, bf16_pure's
rounded update (stochastic and Kahan) and fp8's conversion and refusal."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import compose_config, read_metrics, run, small_run_overrides, train_losses
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm.errors import ConfigError
from llm.launch.launcher import launch
from llm.memory import model_state_bytes
from llm.models import build_model, model_args
from llm.optim import RoundedUpdate
from llm.precision import (
    PrecisionPolicy,
    apply_fp8,
    apply_precision,
    fp8_kernels_problem,
    resolve_precision,
)
from llm.precision.policy import fp8_emulation
from llm.validate import validate

CPU = torch.device("cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("name", "dtypes", "loss_scaling", "rounding"),
    [
        # (param, compute, reduce, master, working)
        ("auto", (F32, F32, F32, F32, F32), False, None),  # CPU: no bf16 autocast default
        ("fp32", (F32, F32, F32, F32, F32), False, None),
        ("fp16", (F32, F16, F32, F32, F16), True, None),
        ("bf16", (F32, BF16, F32, F32, BF16), False, None),
        ("bf16_pure", (BF16, BF16, BF16, BF16, BF16), False, "stochastic"),
    ],
)
def test_policy_dtypes(name, dtypes, loss_scaling, rounding):
    p = resolve_precision(name, CPU)
    got = (
        p.param_dtype,
        p.compute_dtype,
        p.reduce_dtype,
        p.master_dtype,
        p.working_dtype,
    )
    assert got == dtypes
    assert (p.loss_scaling, p.update_rounding, p.fp8) == (loss_scaling, rounding, False)


def test_bf16_pure_takes_the_configured_rounding():
    assert resolve_precision("bf16_pure", CPU, "kahan").update_rounding == "kahan"


def test_reduce_dtype_overrides_the_policy_default():
    assert resolve_precision("bf16", CPU, reduce_dtype="bf16").reduce_dtype == BF16
    assert resolve_precision("bf16_pure", CPU, reduce_dtype="fp32").reduce_dtype == F32
    with pytest.raises(ConfigError, match=r"precision.reduce_dtype='int8' is unknown"):
        resolve_precision("bf16", CPU, reduce_dtype="int8")


def test_tf32_is_refused_on_cpu():
    with pytest.raises(ConfigError, match="precision=tf32 needs an NVIDIA GPU"):
        resolve_precision("tf32", CPU)


def test_fp8_on_cpu_is_emulated_unless_refused():
    for recipe in ("tensorwise", "rowwise", "deepseek"):
        policy = resolve_precision("fp8", CPU, fp8_recipe=recipe)
        assert policy.fp8 and policy.fp8_emulated and policy.fp8_recipe == recipe
    with pytest.raises(ConfigError, match="precision=fp8 needs an NVIDIA GPU") as err:
        resolve_precision("fp8", CPU, fp8_emulate=False)
    assert "precision.fp8_emulate=true" in str(err.value)
    with pytest.raises(ConfigError, match="precision=fp8 needs an NVIDIA GPU"):
        resolve_precision("fp8", CPU, fp8_recipe="deepseek", fp8_emulate=False)


def test_deepseek_runs_our_triton_gemm_where_it_can_and_needs_no_torchao(monkeypatch):
    """On an sm90 GPU without torchao, deepseek still has its kernel (ours); the missing
    package the kernel needs is named, as torchao's is for the other recipes."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    cuda = torch.device("cuda")
    assert fp8_kernels_problem(cuda, "deepseek") is None
    assert fp8_emulation(cuda, "deepseek", None) is False
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert "needs the triton package" in fp8_kernels_problem(cuda, "deepseek")
    assert fp8_emulation(cuda, "deepseek", None) is True


def test_fp8_without_torchao_names_the_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "pip install torchao" in fp8_kernels_problem(torch.device("cuda"))


@pytest.mark.slow
def test_fp8_unemulated_on_cpu_is_one_line_from_the_cli(tmp_path):
    train = Path(__file__).resolve().parent.parent / "train.py"
    args = [
        "precision=fp8",
        "precision.fp8_emulate=false",
        "train.device=cpu",
        f"hydra.run.dir={tmp_path / 'x'}",
    ]
    result = subprocess.run(
        [sys.executable, str(train), *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: precision=fp8 needs an NVIDIA GPU with fp8 tensor cores")
    assert "Traceback" not in result.stderr


FP8_SHAPE = ("model=llama-tiny", "model.d_model=128", "model.n_kv_heads=4", "model.d_ff=384")


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("fp8_reference")
    return run(tmp, "fp32", text_corpus, cache_dir, *FP8_SHAPE, "precision=fp32")[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "deepseek"])
@pytest.mark.slow
def test_fp8_recipes_train_end_to_end_in_emulation(
    tmp_path, text_corpus, cache_dir, fp32_reference, recipe, capfd
):
    """Each recipe trains on CPU, emulated, and the summary says so; fp32 from the same seed
    and data is the yardstick (a few steps of a tiny llama: within 5% at the end). Every
    second step records each linear's quantisation error into the summary."""
    summary, _ = run(
        tmp_path, recipe, text_corpus, cache_dir, *FP8_SHAPE, "precision=fp8",
        f"precision.fp8_recipe={recipe}", "precision.fp8_stats_every=2",
    )  # fmt: skip
    assert summary["fp8_recipe"] == recipe and summary["fp8_emulated"] is True
    assert f"fp8: the {recipe} recipe runs emulated" in capfd.readouterr().err  # the run's log
    ref = fp32_reference["final_train_loss"]
    assert summary["final_train_loss"] == pytest.approx(ref, rel=0.05)
    assert summary["final_train_loss"] != ref  # it did quantise
    stats = summary["fp8_stats"]
    linears = {f"{p}.{w}" for p, ws in LINEARS.items() for w in ws}
    assert set(stats) == {f"layers.{i}.{name}" for i in range(2) for name in linears}
    # deepseek's grad_input reuses the forward's weight blocks: no weight_t cast.
    operands = {"input", "weight", "grad_output", "grad_output_t", "input_t"}
    operands |= set() if recipe == "deepseek" else {"weight_t"}
    recorded = summary["steps"] // 2
    for layer in stats.values():
        assert set(layer) == operands
        for row in layer.values():
            assert row["calls"] == recorded and 0 < row["mean_rel_error"] < 0.1
            assert row["saturated"] == 0  # each scale from its own group's amax


LINEARS = {"attention": ("wq", "wk", "wv", "wo"), "feed_forward": ("w1", "w2", "w3")}


def test_fp8_stats_are_noted_absent_where_no_linear_of_ours_runs(tmp_path, text_corpus, cache_dir):
    summary, _ = run(
        tmp_path, "bf16", text_corpus, cache_dir, "precision=bf16", "precision.fp8_stats_every=1",
        "train.max_steps=2",
    )  # fmt: skip
    assert summary["fp8_stats"] is None
    assert "precision.fp8_stats_every" in summary["fp8_stats_note"]


def test_deepseek_refuses_a_shape_off_its_blocks_before_any_rank_starts(tmp_path):
    cfg = compose_config(
        [
            f"output_dir={tmp_path}",
            "model=gpt2-tiny",
            "precision=fp8",
            "precision.fp8_recipe=deepseek",
            "train.device=cpu",
        ]
    )
    with pytest.raises(ConfigError, match="not multiples of its 128x128 blocks") as err:
        validate(cfg)
    assert "\n" not in str(err.value)


# ---- mixed precision end to end ---------------------------------------------------------
STEPS = 20


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("fp32")
    return run(tmp, "fp32", text_corpus, cache_dir, "precision=fp32", f"train.max_steps={STEPS}")


def logged(out, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_metrics(out) if "loss" in m}


# Largest |loss - fp32 loss| and |grad_norm / fp32 grad_norm - 1| over the 20 steps, with
# about 10x margin over what gpt2-tiny measured on CPU (fp16: 1.8e-4 and 1.8e-4; bf16:
# 4.2e-4 and 9.8e-4; bf16_pure: 1.6e-3 and 3.0e-3). fp16 rounds at 2^-11 relative, bf16 at
# 2^-8, and the loss averages 256 tokens, so per-token rounding mostly cancels; the margin
# absorbs other CPUs' matmul blocking. Each deviation must also be above zero: a run
# bit-equal to fp32 never computed in the reduced precision.
TRACKING = {"fp16": (2e-3, 2e-3), "bf16": (5e-3, 1e-2), "bf16_pure": (2e-2, 3e-2)}


@pytest.mark.parametrize("name", sorted(TRACKING))
@pytest.mark.slow
def test_reduced_precision_tracks_fp32(tmp_path, text_corpus, cache_dir, fp32_run, name):
    ref_summary, ref = fp32_run
    summary, out = run(
        tmp_path, name, text_corpus, cache_dir, f"precision={name}", f"train.max_steps={STEPS}"
    )
    loss_tol, norm_tol = TRACKING[name]
    losses, ref_losses = train_losses(out), train_losses(ref)
    assert losses.keys() == ref_losses.keys() and len(losses) == STEPS
    loss_dev = max(abs(losses[s] - ref_losses[s]) for s in losses)
    norms, ref_norms = logged(out, "grad_norm"), logged(ref, "grad_norm")
    norm_dev = max(abs(norms[s] / ref_norms[s] - 1) for s in norms)
    assert 0 < loss_dev < loss_tol and 0 < norm_dev < norm_tol, (loss_dev, norm_dev)
    assert losses[STEPS] < losses[1] - 1.0

    n = summary["n_params"]
    state = summary["model_state_bytes"][0]
    if name == "fp16":
        # The deepspeed preset's initial scale throughout: growth needs 1000 clean steps.
        assert set(logged(out, "loss_scale").values()) == {2.0**16}
        assert summary["skipped_steps"] == 0
    if name == "bf16_pure":
        # No fp32 copy anywhere: 2-byte params, grads and AdamW moments (4 bytes for two),
        # plus one fp32 "step" scalar per parameter tensor.
        assert state["params"] == state["grads"] == 2 * n
        assert 4 * n <= state["optimizer_states"] < 5 * n
    else:
        assert state == ref_summary["model_state_bytes"][0]  # fp32 master weights and states


# ---- bf16_pure's rounded update ---------------------------------------------------------
LR, UPDATES = 4e-4, 250  # each update 4e-4: 1/20 of a bf16 ulp at 1.0 (2^-7)
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR),
    # beta2 0.95 as our config. With 0.999 an EMA step (0.1% of the moment) is below bf16's
    # half-ulp (2^-9), so round-to-nearest moments stall and Adam's steps drift from fp32's.
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0),
}


def descend(optimizer, param: torch.Tensor) -> torch.Tensor:
    """UPDATES steps along a gradient of ones, from 1.0; in fp32 that ends at 0.9."""
    for _ in range(UPDATES):
        param.grad = torch.ones_like(param)
        optimizer.step()
    return param.detach().float()


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_round_to_nearest_loses_sub_ulp_updates(opt):
    w = nn.Parameter(torch.ones(64, dtype=BF16))
    assert torch.equal(descend(OPTIMIZERS[opt]([w]), w), torch.ones(64))  # never moved


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_rounded_update_reaches_the_fp32_result(opt, mode):
    torch.manual_seed(0)
    ref = nn.Parameter(torch.ones(4096))
    expected = descend(OPTIMIZERS[opt]([ref]), ref)
    assert torch.allclose(expected, torch.full_like(expected, 0.9), atol=1e-4)
    w = nn.Parameter(torch.ones(4096, dtype=BF16))
    optimizer = RoundedUpdate(OPTIMIZERS[opt]([w]), mode)
    err = descend(optimizer, w) - expected
    assert w.dtype == BF16
    if mode == "stochastic":
        # Unbiased: the mean error is noise, sigma = 0.019 / sqrt(4096) = 3e-4 (measured
        # 4.6e-4), 2e-3 is ~7 sigma; each element's error is a random walk of ulp-sized
        # steps (RMS measured 0.019). Round-to-nearest would be off by 0.1.
        assert err.mean().abs() < 2e-3 and err.square().mean().sqrt() < 0.04
    else:
        # Deterministic: within one bf16 ulp at 0.9 (2^-8 = 3.9e-3; measured 1.6e-3), and
        # the weight plus its compensation within 2e-3 of fp32 (measured 3.9e-4: the bf16
        # buffer adds about 8 bits, not fp32's 24).
        assert err.abs().max() <= 2**-8
        comp = optimizer.state[w]["kahan_comp"].float()
        assert (err + comp).abs().max() < 2e-3


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_rounded_update_is_still_the_optimizer(mode):
    """LR schedulers, step hooks, memory accounting and DCP's state-dict API see the plain
    optimizer; states are bf16, and Kahan's buffer travels with the optimizer state."""

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(BF16)
        opt = RoundedUpdate(torch.optim.AdamW(model.parameters(), lr=1e-2), mode)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        steps = []
        opt.register_step_post_hook(lambda *args: steps.append(1))
        return model, opt, sched, steps

    def train_step(model, opt, sched):
        torch.manual_seed(1)  # the same stochastic-rounding noise for both copies
        opt.zero_grad()
        model(torch.ones(3, 4, dtype=BF16)).float().square().mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            opt.step()
            sched.step()

    model, opt, sched, steps = build()
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "RoundedAdamW"
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, sched)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3) and steps == [1]

    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"kahan_comp"} if mode == "kahan" else set())
    params = list(model.parameters())
    for p in params:
        state = opt.state[p]
        assert set(state) == keys
        assert all(v.dtype == (F32 if k == "step" else BF16) for k, v in state.items())
    n = sum(p.numel() for p in params)
    moments = (6 if mode == "kahan" else 4) * n
    assert model_state_bytes(model, opt)["optimizer_states"] == moments + 4 * len(params)

    # A checkpoint's round trip through DCP's API into a fresh copy; both then step alike.
    # (Deep-copied as saving would: loading aliases same-dtype state tensors.)
    model_sd, optim_sd = copy.deepcopy(get_state_dict(model, opt))
    assert (mode == "kahan") == any(k.endswith("kahan_comp") for k in _flat_keys(optim_sd))
    model2, opt2, sched2, steps2 = build()
    set_state_dict(model2, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    sched2.load_state_dict(sched.state_dict())
    train_step(model, opt, sched)
    train_step(model2, opt2, sched2)
    for p, p2 in zip(params, model2.parameters(), strict=True):
        assert torch.equal(p, p2)
        assert all(torch.equal(v, opt2.state[p2][k]) for k, v in opt.state[p].items())
    # Step hooks ran once per step, also after load_state_dict re-patched step functions.
    assert steps == [1, 1] and len(steps2) == 2  # DCP's lazy state init stepped opt2 once


def _flat_keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_shard_pieces_stay_views_of_their_buffer(mode):
    """Our ZeRO hands the optimizer 1-D pieces of a flat buffer: updates must land there."""
    flat = torch.ones(10, dtype=BF16)
    pieces = list(flat.split([6, 4]))
    opt = RoundedUpdate(torch.optim.SGD(pieces, lr=0.25), mode)
    for piece in pieces:
        piece.grad = torch.ones_like(piece)
    opt.step()
    assert torch.equal(flat, torch.full((10,), 0.75, dtype=BF16))  # exact in bf16
    assert pieces[1].data_ptr() == flat.data_ptr() + 6 * flat.element_size()


# ---- how the model meets the policy ------------------------------------------------------
def tiny_model() -> nn.Module:
    return build_model(model_args("gpt2-tiny", vocab_size=256))  # on the meta device


def test_bf16_pure_model_has_bf16_weights_and_others_keep_fp32():
    pure = apply_precision(tiny_model(), resolve_precision("bf16_pure", CPU))
    assert {p.dtype for p in pure.parameters()} == {BF16}
    mixed = apply_precision(tiny_model(), resolve_precision("bf16", CPU))
    assert {p.dtype for p in mixed.parameters()} == {F32}


def test_apply_fp8_is_a_no_op_unless_fp8():
    model = tiny_model()
    assert apply_fp8(model, resolve_precision("bf16", CPU)) is model
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_apply_fp8_converts_block_linears_only():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    # torchao's path, as on a GPU (on a CPU resolve_precision picks emulation).
    fp8 = PrecisionPolicy("fp8", F32, BF16, F32, fp8=True, fp8_recipe="tensorwise")
    model = tiny_model()
    model.layers[0].feed_forward.add_module("odd", nn.Linear(64, 24, device="meta"))
    converted = {n for n, m in apply_fp8(model, fp8).named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # The output head and the 24-wide layer stay; every other linear is float8.
    assert converted == linears - {"output", "layers.0.feed_forward.odd"} and converted


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with fp8 tensor cores (sm89+)",
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "deepseek"])
def test_fp8_trains_on_gpu(tmp_path, text_corpus, cache_dir, recipe):
    """Each recipe on its real kernels: torchao's Float8Linear, or our Triton GEMM."""
    pytest.importorskip("triton" if recipe == "deepseek" else "torchao.float8")
    out = tmp_path / "fp8"
    overrides = small_run_overrides(
        out, text_corpus, cache_dir, *FP8_SHAPE, "precision=fp8", f"train.max_steps={STEPS}",
        f"precision.fp8_recipe={recipe}", "precision.fp8_emulate=false",
    )  # fmt: skip
    summary = launch(compose_config([o for o in overrides if o != "train.device=cpu"]))
    assert summary["precision"] == "fp8" and summary["device"] == "cuda"
    assert summary["fp8_recipe"] == recipe and summary["fp8_emulated"] is False
    losses = train_losses(out)
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 1.0
