"""Our Triton kernels compile for Ampere and Hopper without a GPU, in every autotune config.

The interpreter (test_triton_flash.py) checks the arithmetic but not what only the compiler
sees: types that differ between loop iterations, a constexpr branch the interpreter takes
as Python, shared memory. Triton's wheel carries ptxas, so the kernels compile to cubins on
this CPU machine; each config must fit the shared memory of the GPUs it is meant for,
or the autotuner would only find out on a GPU, at every first use.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llm.attention import triton_bwd, triton_configs, triton_fwd  # noqa: E402

pytestmark = pytest.mark.slow  # 25 compilations of 5-15 s each on a 2-core machine

# Shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes.
SHARED_MEMORY = {80: 166912, 90: 232448}
POINTERS_FP32 = {"LSE", "DELTA"}
POINTERS_I32 = {"DOC", "DOC_START", "DOC_END"}
KERNELS = {
    "fwd": triton_fwd.flash_fwd_kernel,
    "dkdv": triton_bwd.flash_bwd_dkdv_kernel,
    "dq": triton_bwd.flash_bwd_dq_kernel,
}


def signature(fn, constexprs: dict, dtype: str) -> dict:
    """Triton's type string per argument: tensors are pointers, the rest i32 or fp32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS_FP32:
            sig[name] = "*fp32"
        elif name in POINTERS_I32:
            sig[name] = "*i32"
        elif name in ("qk_scale", "scale"):
            sig[name] = "fp32"
        elif name in ("H", "N_REP", "T") or name.startswith("stride"):
            sig[name] = "i32"
        else:
            sig[name] = "*" + dtype
    return sig


def compile_kernel(kernel, config, arch: int, dtype: str, **constexprs):
    constexprs = {**constexprs, **config.kwargs}
    fn = kernel.fn
    src = ASTSource(fn, signature(fn, constexprs, dtype), constexprs=constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _bf16_d128(kernel, config, arch):
    """Head dim 128 (the largest tiles), bf16, causal with documents (every branch)."""
    return compile_kernel(
        kernel, config, arch, "bf16", HEAD_DIM=128, CAUSAL=True, HAS_DOCS=True, DOT_PRECISION="tf32"
    )


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_tuned_config_compiles_for_ampere_within_its_shared_memory(name):
    """A100's shared memory is the smaller: what fits there fits an H100."""
    kernel = KERNELS[name]
    configs = getattr(triton_configs, f"prune_{name}")(kernel.configs, {}, HEAD_DIM=128)
    assert configs, "no configuration left for head dim 128"
    for config in configs:
        shared = _bf16_d128(kernel, config, 80).metadata.shared
        assert shared <= SHARED_MEMORY[80], (config, shared)


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_compile_for_hopper(name):
    """Hopper's code generation differs (wgmma): the first configuration of each kernel."""
    kernel = KERNELS[name]
    assert _bf16_d128(kernel, kernel.configs[0], 90).metadata.shared <= SHARED_MEMORY[90]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "precision"), [("fp16", 32, "tf32"), ("fp32", 64, "ieee")]
)
def test_other_dtypes_and_head_dims_compile(dtype, head_dim, precision):
    for kernel in KERNELS.values():
        compile_kernel(
            kernel, kernel.configs[0], 80, dtype,
            HEAD_DIM=head_dim, CAUSAL=True, HAS_DOCS=True, DOT_PRECISION=precision,
        )  # fmt: skip


def test_delta_kernel_compiles():
    fn = triton_bwd.flash_bwd_delta_kernel
    constexprs = {"HEAD_DIM": 128, "BLOCK_M": 64}
    sig = signature(fn, constexprs, "bf16")
    triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
