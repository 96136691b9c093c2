"""Precision policies: which dtype parameters, compute, gradient reduction and optimizer
states use, whether losses are scaled, and how bf16-only weights are updated.

Replica strategies (single, ddp) and FSDP keep ``param_dtype`` weights and autocast to
``compute_dtype``. Our ZeRO and DeepSpeed instead hold 16-bit working weights and gradients
(``working_dtype``) with ``master_dtype`` copies inside the partitioned optimizer, the
layout the ZeRO paper's 2+2+12 bytes per parameter assumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from llm.config import Config
from llm.errors import ConfigError


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype  # what the optimizer updates (master weights)
    compute_dtype: torch.dtype  # what matmuls run in (autocast)
    # What gradients are reduced in across data-parallel ranks (every strategy divides them
    # by the dp size before the reduction); precision.reduce_dtype overrides the default.
    reduce_dtype: torch.dtype
    allow_tf32: bool = False
    master_dtype: torch.dtype = torch.float32  # the weights the optimizer updates
    loss_scaling: bool = False  # fp16: gradients underflow without a loss scale
    update_rounding: str | None = None  # bf16_pure: "stochastic" | "kahan"
    fp8: bool = False  # float8 matmuls inside the compute dtype
    fp8_recipe: str | None = None  # tensorwise | rowwise | deepseek (precision=fp8)
    # Quantised and dequantised in fp32 (llm/precision/fp8/), not torchao's fp8 kernels.
    fp8_emulated: bool = False

    @property
    def working_dtype(self) -> torch.dtype:
        """Weights and gradients a ZeRO/DeepSpeed rank computes with: 16-bit under mixed
        precision (the fp32 master lives in the optimizer), else the parameter dtype."""
        return self.compute_dtype if self.compute_dtype.itemsize < 4 else self.param_dtype

    @property
    def flops_dtype(self) -> torch.dtype | str:
        """What the matmuls run at, as the peak-FLOP/s table names it ("tf32" is no dtype)."""
        return (
            "tf32"
            if self.allow_tf32 and self.compute_dtype == torch.float32
            else self.compute_dtype
        )

    def autocast(self, device: torch.device):
        """Autocast to the compute dtype; a no-op when it equals the parameter dtype."""
        if self.compute_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def apply_backend_flags(self) -> None:
        # TF32 is a process-wide switch in torch, so the policy sets it once per rank.
        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
            torch.backends.cudnn.allow_tf32 = self.allow_tf32


def bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(
    name: str,
    device: torch.device,
    update_rounding: str = "stochastic",
    reduce_dtype: str | None = None,
    fp8_recipe: str = "tensorwise",
    fp8_emulate: bool | None = None,
) -> PrecisionPolicy:
    """Turn a precision name into a policy for this device; impossible pairs are refused.
    ``reduce_dtype`` (fp32 | bf16 | fp16) replaces the policy's own; None keeps it.
    ``fp8_recipe`` and ``fp8_emulate``: precision=fp8's scaling and whether it is emulated
    (:func:`fp8_emulation`)."""
    policy = _named_policy(name, device, update_rounding, fp8_recipe, fp8_emulate)
    if reduce_dtype is None:
        return policy
    if reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(
            f"precision.reduce_dtype={reduce_dtype!r} is unknown; choose one of "
            f"{', '.join(REDUCE_DTYPES)} (or leave it unset for the policy's own)"
        )
    return dataclasses.replace(policy, reduce_dtype=REDUCE_DTYPES[reduce_dtype])


def precision_for(cfg: Config, device: torch.device) -> PrecisionPolicy:
    """The run's precision policy on ``device``, from every precision.* key."""
    p = cfg.precision
    return resolve_precision(
        p.name, device, p.update_rounding, p.reduce_dtype, p.fp8_recipe, p.fp8_emulate
    )


def _named_policy(
    name: str, device: torch.device, update_rounding: str, fp8_recipe: str, fp8_emulate: bool | None
) -> PrecisionPolicy:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    if name == "auto":
        name = "bf16" if bf16_supported(device) else "fp32"
    if name == "fp32":
        return PrecisionPolicy("fp32", f32, f32, f32)
    if name == "tf32":
        if device.type != "cuda":
            raise ConfigError(
                "precision=tf32 needs an NVIDIA GPU (Ampere or newer); use precision=fp32"
            )
        return PrecisionPolicy("tf32", f32, f32, f32, allow_tf32=True)
    if (
        name in ("bf16", "bf16_pure", "fp8")
        and device.type == "cuda"
        and not bf16_supported(device)
    ):
        raise ConfigError(f"precision={name}: this GPU has no bf16; use precision=fp16 or fp32")
    if name == "fp16":
        # fp32 master weights, fp16 matmuls, gradients scaled so they do not underflow.
        return PrecisionPolicy("fp16", f32, f16, f32, allow_tf32=True, loss_scaling=True)
    if name == "bf16":
        # fp32 master weights, gradients reduced in fp32: autocast casts only the compute.
        return PrecisionPolicy("bf16", f32, bf16, f32, allow_tf32=True)
    if name == "bf16_pure":
        # No fp32 copy anywhere: the update is rounded so small steps still land.
        return PrecisionPolicy(
            "bf16_pure", bf16, bf16, bf16, master_dtype=bf16, update_rounding=update_rounding
        )
    if name == "fp8":
        emulated = fp8_emulation(device, fp8_recipe, fp8_emulate)
        return PrecisionPolicy(
            "fp8",
            f32,
            bf16,
            f32,
            allow_tf32=True,
            fp8=True,
            fp8_recipe=fp8_recipe,
            fp8_emulated=emulated,
        )
    raise ConfigError(
        f"precision={name!r} is unknown; choose one of auto, fp32, tf32, fp16, bf16, bf16_pure, fp8"
    )


def fp8_emulation(device: torch.device, recipe: str, emulate: bool | None) -> bool:
    """Whether fp8 runs emulated: as asked, else where the real kernels cannot run (torchao's
    for tensorwise and rowwise, our Triton GEMM for deepseek); refused in one line where the
    real kernels are asked for and cannot run."""
    problem = fp8_kernels_problem(device, recipe)
    if emulate is None:
        return problem is not None
    if not emulate and problem:
        raise ConfigError(f"{problem}, or set precision.fp8_emulate=true to emulate it")
    return emulate


def fp8_kernels_problem(device: torch.device, recipe: str = "tensorwise") -> str | None:
    """Why the recipe's real kernels cannot run here, or None: torchao's float8 training,
    or for deepseek our Triton GEMM (llm/precision/fp8/triton_gemm.py)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "precision=fp8 needs an NVIDIA GPU with fp8 tensor cores (sm89+, e.g. H100)"
    if recipe == "deepseek":
        from llm.precision.fp8.triton_gemm import fp8_gemm_unavailable

        return fp8_gemm_unavailable(device)
    # find_spec, not import: torchao's import loads CUDA extensions, slow and noisy.
    if importlib.util.find_spec("torchao") is None:
        return "precision=fp8 needs torchao for float8 training (pip install torchao)"
    return None


def apply_precision(model: nn.Module, policy: PrecisionPolicy) -> nn.Module:
    """The model in the policy's parameter dtype (bf16 under bf16_pure: no fp32 copy
    exists), with float8 linears under fp8. Safe on the meta device, before weights exist."""
    return apply_fp8(model.to(policy.param_dtype), policy)


def apply_fp8(model: nn.Module, policy: PrecisionPolicy) -> nn.Module:
    """Swap the linears for fp8 ones when the policy says fp8; a no-op otherwise. Emulated:
    our Fp8Linear (llm/precision/fp8/) with the recipe's scales; else torchao's Float8Linear
    with its recipe (tensorwise: dynamic per-tensor scales; rowwise).

    As torchtitan does, the output head stays in high precision (the logits feed a softmax
    over the whole vocabulary and are the most sensitive to quantisation), and so does any
    linear whose dimensions are not multiples of 16, which fp8 tensor cores require.
    """
    if not policy.fp8:
        return model
    if policy.fp8_emulated or policy.fp8_recipe == "deepseek":
        from llm.precision.fp8 import convert_to_fp8

        kernel = not policy.fp8_emulated  # deepseek on our Triton GEMM
        return convert_to_fp8(model, policy.fp8_recipe, kernel)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(policy.fp8_recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=_fp8_eligible)


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    out_features, in_features = module.weight.shape
    return fqn != "output" and out_features % 16 == 0 and in_features % 16 == 0
