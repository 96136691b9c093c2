"""Our Triton GEMM for DeepSeek-V3's fine-grained fp8 scaling against exact products.

CPU: the kernel runs in Triton's interpreter, in a subprocess (see fp8_triton_cases.py), for
each of Fp8Linear's three GEMM layouts. Bounds, with u = 2^-24 (fp32) and
mag = |dequant(a)| @ |dequant(b)|^T in float64:

- kernel vs the exact product (float64 of the dequantised codes, whose code * scale products
  are exact there): each e4m3 code product is exact in fp32 (4-bit significands), so the
  kernel's only errors are the fp32 sums of a chunk's 128 products, the scale product
  sa * sb, the partial times it, and the K / 128 additions into the accumulator:
  |err| <= (128 + K / 128 + 3) u mag (Higham's gamma_n, any summation order).
- our emulated path (linear.py: dequantise in fp32, one fp32 matmul) vs exact: one rounding
  of each code * scale per operand and K fp32 additions, (K + 3) u mag; so the kernel and
  the emulated path differ by at most the sum of the two.
- an fp16 output adds one rounding of the result, 2^-11 of it; a bf16 one up to one ulp,
  2^-7 of it: the interpreter truncates fp32 to bf16 (its cast_impl takes no rounding
  mode), where a GPU rounds to nearest (2^-8).
A wrong scale (a chunk's, a row's, a block's) is off by a factor of the order of that scale,
far outside these bounds, which are near 1e-5 of mag.

GPU (`-m gpu`): the compiled kernel, whose fp8 tensor-core dot aligns a chunk's products to
the largest and keeps about 14 bits (DeepSeek-V3 §3.3.2), so that each of the 128 loses up
to 2^-13 of the largest and a chunk's sum up to about 2^-8 of its sum of |products|: within
2^-8 of mag, plus the output's rounding. That bound checks scales, masks and layouts (a
wrong scale is off by the output's own size); it is too loose to show what promoting each
chunk gains over one long fp8 dot, which is a matter of typical, not worst, error.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_triton_cases import CASES, Case, operands, run_linear

from llm.errors import ConfigError
from llm.precision.fp8.scaling import DEEPSEEK_RULE, TILE
from llm.precision.fp8.triton_gemm import fp8_blockwise_mm

REPO = Path(__file__).resolve().parent.parent
U = 2.0**-24
OUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11}
FP16_TINY = 2.0**-25  # half fp16's smallest subnormal: a result that small may round to 0


def expanded(scale: torch.Tensor, rows: int, blocks: bool) -> torch.Tensor:
    """(R, K/128) scales -> (rows, K) in float64, one per element they multiply."""
    s = scale.double().repeat_interleave(TILE, dim=1)
    return s.repeat_interleave(TILE, dim=0)[:rows] if blocks else s


def dequantised(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """dequant(a) (M, K) and dequant(b) (N, K), exact in float64."""
    a_hat = x["a"].double() * expanded(x["a_scale"], x["a"].size(0), blocks=False)
    b_hat = x["b"].double() * expanded(x["b_scale"], x["b"].size(0), x["b_blocks"])
    return a_hat, b_hat


def assert_within(got, want, bound, what: str) -> None:
    err = (got.double() - want.double()).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} "
        f"at flat index {int(worst)}"
    )


def kernel_bound(x: dict, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product (M, N) and how far the kernel may be from it (module docstring)."""
    a_hat, b_hat = dequantised(x)
    exact, mag = a_hat @ b_hat.t(), a_hat.abs() @ b_hat.abs().t()
    k = a_hat.size(1)
    bound = (TILE + k // TILE + 3) * U * mag
    bound = bound + OUT_ROUNDING[out_dtype] * (exact.abs() + bound)
    return exact, bound + (FP16_TINY if out_dtype == torch.float16 else 0.0)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The kernel's output for every case, computed in Triton's interpreter."""
    pytest.importorskip("triton")  # a requirement on Linux; no wheels elsewhere
    from llm.attention.triton_flash import triton_interpreter_problem

    if why := triton_interpreter_problem():  # triton 3.6 (torch 2.11) with numpy 2.4
        pytest.skip(why)
    path = tmp_path_factory.mktemp("fp8_triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = Path(__file__).parent / "fp8_triton_cases.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_exact_and_emulated_gemm(interpreted, name):
    case = CASES[name]
    x = operands(case)
    ours = interpreted["cases"][name]
    assert ours.dtype == case.out_dtype
    assert ours.shape == x["emulated"].shape
    exact, bound = kernel_bound(x, case.out_dtype)
    assert_within(ours, exact, bound, "kernel vs exact")
    k = x["a"].size(1)
    emulated_bound = bound + (k + 3) * U * dequantised_mag(x)
    assert_within(ours, x["emulated"], emulated_bound, "kernel vs emulated fp32 path")


def test_fp8_linear_on_the_kernel_equals_its_emulation(interpreted):
    """Fp8Linear(kernel=True) (interpreted here) against the emulated Fp8Linear in fp32: the
    same codes and scales from the same input and weight, so the same stats to the bit for
    them; outputs and gradients equal up to fp32 summation order (2e-6 of each tensor's
    largest value: the bounds above, at this K of at most 384 and magnitudes of order one),
    and the gradients' stats within that too (the loss's gradient is 2 * output)."""
    kernel, emulated = interpreted["linear"], run_linear(kernel=False)
    for operand in ("input", "weight", "input_t"):
        assert kernel["stats"][operand] == emulated["stats"][operand], operand
    for operand in ("grad_output", "grad_output_t"):
        ours, ref = kernel["stats"][operand], emulated["stats"][operand]
        assert ours["mean_rel_error"] == pytest.approx(ref["mean_rel_error"], rel=1e-5)
    for name in ("output", "grad_input", "grad_weight", "grad_bias"):
        ours, ref = kernel[name], emulated[name]
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6 * ref.abs().max().item())


def dequantised_mag(x: dict) -> torch.Tensor:
    a_hat, b_hat = dequantised(x)
    return a_hat.abs() @ b_hat.abs().t()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.outlier])
def test_outlier_cases_hold_an_outlier_and_a_zero_tile(name):
    """What the outlier cases claim to test is in their operands: one tile's scale 1e4 above
    the typical one, and an all-zero tile (its scale the amax floor, its codes 0)."""
    x = operands(CASES[name])
    scale = x["a_scale"]
    assert scale.max() > 1e3 * scale.median()
    floored = scale == DEEPSEEK_RULE.amax_floor / 448
    assert floored.any()
    zero_tile = floored.nonzero()[0]
    row, chunk = int(zero_tile[0]), int(zero_tile[1])
    assert (x["a"][row, chunk * TILE : (chunk + 1) * TILE].float() == 0).all()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.chunk_factors])
def test_each_chunk_is_promoted_with_its_own_scales(interpreted, name):
    """With scales that differ by 1e6 between K chunks, no one scale per row and column
    factors out of the dot product: a kernel that summed all of K's code products and then
    applied the first chunk's (or the last chunk's) scales would be far outside the bound,
    as these stand-ins for such a kernel show; ours is inside it."""
    case = CASES[name]
    x = operands(case)
    k = x["a"].size(1)
    for scale in (x["a_scale"], x["b_scale"]):
        assert (scale.amax(dim=1) > 1e4 * scale.amin(dim=1)).all()
    exact, bound = kernel_bound(x, case.out_dtype)
    assert_within(interpreted["cases"][name], exact, bound, "kernel vs exact")
    codes = x["a"].double() @ x["b"].double().t()  # (M, N), all of K's code products summed
    b_rows = expanded(x["b_scale"], x["b"].size(0), x["b_blocks"])[:, ::TILE]  # (N, K/128)
    for chunk in (0, k // TILE - 1):
        one_scale = codes * x["a_scale"][:, chunk, None].double() * b_rows[None, :, chunk]
        assert ((one_scale - exact).abs() > bound).float().mean() > 0.9, chunk


def test_interpreter_used_its_one_configuration(interpreted):
    from llm.precision.fp8.triton_gemm_kernel import INTERPRETER_BLOCKS

    rows = interpreted["tuned"]
    assert {(r["BLOCK_M"], r["BLOCK_N"]) for r in rows} == {INTERPRETER_BLOCKS}
    keys = {r["key"][:4] for r in rows}
    for case in CASES.values():
        x = operands(case)
        want = (x["a"].size(0), x["b"].size(0), x["a"].size(1), x["b_blocks"])
        assert want in keys


def _fp8(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("a", "a_scale", "b", "b_scale", "b_blocks", "match"),
    [
        (_fp8(4, 100), torch.ones(4, 1), _fp8(8, 100), torch.ones(1, 1), True, "multiple of 128"),
        (_fp8(4, 128), torch.ones(4, 1), _fp8(8, 256), torch.ones(1, 2), True, "same K"),
        (torch.randn(4, 128), torch.ones(4, 1), _fp8(8, 128), torch.ones(1, 1), True, "e4m3fn"),
        (
            torch.randn(4, 128).to(torch.float8_e5m2), torch.ones(4, 1),
            _fp8(8, 128), torch.ones(1, 1), True, "e4m3fn",
        ),
        (_fp8(4, 256), torch.ones(4, 1), _fp8(8, 256), torch.ones(1, 2), True, r"a_scale .*\(4, 2\)"),
        (_fp8(4, 256), torch.ones(4, 2), _fp8(8, 256), torch.ones(8, 2), True, "128x128 blocks"),
        (_fp8(4, 256), torch.ones(4, 2), _fp8(200, 256), torch.ones(2, 2), False, "b_scale .*1x128 tiles"),
        (_fp8(4, 128), torch.ones(4, 1, dtype=torch.bfloat16), _fp8(8, 128), torch.ones(1, 1),
         True, "float32"),
    ],
)  # fmt: skip
def test_bad_operands_are_refused_in_one_line(a, a_scale, b, b_scale, b_blocks, match):
    with pytest.raises(ConfigError, match=match) as err:
        fp8_blockwise_mm(a, a_scale, b, b_scale, b_blocks=b_blocks)
    assert "\n" not in str(err.value)


def test_unsupported_out_dtype_is_refused():
    with pytest.raises(ConfigError, match="writes"):
        fp8_blockwise_mm(
            _fp8(4, 128), torch.ones(4, 1), _fp8(8, 128), torch.ones(1, 1),
            b_blocks=True, out_dtype=torch.float8_e4m3fn,
        )  # fmt: skip


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="CUDA tensors") as err:
        fp8_blockwise_mm(
            _fp8(4, 128), torch.ones(4, 1), _fp8(8, 128), torch.ones(1, 1), b_blocks=True
        )
    assert "\n" not in str(err.value)


def test_without_triton_the_module_imports_and_the_call_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "llm.precision.fp8.triton_gemm")
    module = importlib.import_module("llm.precision.fp8.triton_gemm")
    with pytest.raises(ConfigError, match=r"triton==3\.9\.0"):
        module.fp8_blockwise_mm(
            _fp8(4, 128), torch.ones(4, 1), _fp8(8, 128), torch.ones(1, 1), b_blocks=True
        )


def test_no_rows_give_an_empty_product_without_a_kernel():
    out = fp8_blockwise_mm(
        _fp8(0, 128), torch.ones(0, 1), _fp8(8, 128), torch.ones(1, 1), b_blocks=True
    )
    assert out.shape == (0, 8) and out.dtype == torch.float32


GPU_CASES = {
    "output_ragged_tokens": Case("output", 1000, 640, 384),
    "output_deep_K4096": Case("output", 256, 256, 4096),
    "output_ragged_N": Case("output", 512, 300, 512, outlier=True),
    "grad_input": Case("grad_input", 1000, 640, 300, outlier=True),
    "grad_weight": Case("grad_weight", 1000, 640, 384, outlier=True),
    "grad_weight_chunk_scales": Case("grad_weight", 300, 256, 200, chunk_factors=(1e-3, 1e2, 1.0)),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+)",
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_compiled_kernel_matches_exact_and_emulated_gemm(name, out_dtype):
    pytest.importorskip("triton")
    cuda = operands(GPU_CASES[name], device="cuda")
    ours = fp8_blockwise_mm(
        cuda["a"], cuda["a_scale"], cuda["b"], cuda["b_scale"],
        b_blocks=cuda["b_blocks"], out_dtype=out_dtype,
    ).cpu()  # fmt: skip
    x = {key: t.cpu() if isinstance(t, torch.Tensor) else t for key, t in cuda.items()}
    assert ours.dtype == out_dtype
    exact, _ = kernel_bound(x, torch.float32)
    mag = dequantised_mag(x)
    bound = 2.0**-8 * mag
    bound = bound + OUT_ROUNDING[out_dtype] * (exact.abs() + bound)
    assert_within(ours, exact, bound, "kernel vs exact")
    k = x["a"].size(1)
    assert_within(ours, x["emulated"], bound + (k + 3) * U * mag, "kernel vs emulated")
