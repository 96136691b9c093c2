"""Precision policies: which dtype parameters, compute, gradient reduction and optimizer
states use. This issue ships fp32, tf32 and bf16 autocast; fp16 with our loss scaler,
bf16_pure and fp8 come with the model-state-memory work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from llm.errors import ConfigError


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype  # what the optimizer updates (master weights)
    compute_dtype: torch.dtype  # what matmuls run in (autocast)
    reduce_dtype: torch.dtype  # what gradients are all-reduced in
    optimizer_state_dtype: torch.dtype
    allow_tf32: bool = False

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


def resolve_precision(name: str, device: torch.device) -> PrecisionPolicy:
    """Turn a precision name into a policy for this device; impossible pairs are refused."""
    f32 = torch.float32
    if name == "auto":
        name = "bf16" if bf16_supported(device) else "fp32"
    if name == "fp32":
        return PrecisionPolicy("fp32", f32, f32, f32, f32)
    if name == "tf32":
        if device.type != "cuda":
            raise ConfigError(
                "precision=tf32 needs an NVIDIA GPU (Ampere or newer); use precision=fp32"
            )
        return PrecisionPolicy("tf32", f32, f32, f32, f32, allow_tf32=True)
    if name == "bf16":
        if device.type == "cuda" and not bf16_supported(device):
            raise ConfigError("precision=bf16: this GPU has no bf16; use precision=fp32")
        # fp32 master weights, gradients reduced in fp32: autocast casts only the compute.
        return PrecisionPolicy("bf16", f32, torch.bfloat16, f32, f32, allow_tf32=True)
    raise ConfigError(f"precision={name!r} is unknown; choose one of auto, fp32, tf32, bf16")
