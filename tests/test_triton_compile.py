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

pytestmark = pytest.mark.slow  # ~60 compilations of 5-15 s each on a 2-core machine

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


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_tuned_config_compiles_and_fits_shared_memory(name, arch):
    """Head dim 128 (the largest tiles), bf16, causal with documents (every branch)."""
    kernel = KERNELS[name]
    prune = getattr(triton_configs, f"prune_{name}")
    configs = prune(kernel.configs, {}, HEAD_DIM=128)
    assert configs, "no configuration left for head dim 128"
    for config in configs:
        compiled = compile_kernel(
            kernel, config, arch, "bf16",
            HEAD_DIM=128, CAUSAL=True, HAS_DOCS=True, DOT_PRECISION="tf32",
        )  # fmt: skip
        assert compiled.metadata.shared <= SHARED_MEMORY[arch], (config, compiled.metadata.shared)


@pytest.mark.parametrize(("dtype", "precision"), [("fp16", "tf32"), ("fp32", "ieee")])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_other_dtypes_and_head_dims_compile(dtype, precision, head_dim):
    for kernel in KERNELS.values():
        config = kernel.configs[0]
        for causal, docs in ((False, False), (True, False)):
            compile_kernel(
                kernel, config, 90, dtype,
                HEAD_DIM=head_dim, CAUSAL=causal, HAS_DOCS=docs, DOT_PRECISION=precision,
            )  # fmt: skip


def test_delta_kernel_compiles():
    fn = triton_bwd.flash_bwd_delta_kernel
    constexprs = {"HEAD_DIM": 128, "BLOCK_M": 64}
    sig = signature(fn, constexprs, "bf16")
    triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
