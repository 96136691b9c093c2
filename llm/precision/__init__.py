"""Precision: policies (which dtype holds, computes and reduces what) and our dynamic loss
scaler.

May import llm.config and llm.errors only."""

from llm.precision.loss_scale import (
    LossScaler,
    LossScalerSettings,
    build_loss_scaler,
    disabled_loss_scaler,
)
from llm.precision.policy import (
    REDUCE_DTYPES,
    PrecisionPolicy,
    apply_fp8,
    apply_precision,
    bf16_supported,
    fp8_kernels_problem,
    precision_for,
    resolve_precision,
)

__all__ = [
    "REDUCE_DTYPES",
    "LossScaler",
    "LossScalerSettings",
    "PrecisionPolicy",
    "apply_fp8",
    "apply_precision",
    "bf16_supported",
    "build_loss_scaler",
    "disabled_loss_scaler",
    "fp8_kernels_problem",
    "precision_for",
    "resolve_precision",
]
