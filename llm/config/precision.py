"""``precision.*``: the precision policy, the loss scaler's settings and fp8 (conf/precision/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError

LOSS_SCALER_PRESETS = ("deepspeed", "megatron", "torch")


@dataclass
class PrecisionConfig:
    name: str = "auto"  # auto | fp32 | tf32 | fp16 | bf16 | bf16_pure | fp8
    # Dynamic loss scaling (fp16): a preset's defaults (docs/references.md), each overridable.
    loss_scaler: str = "deepspeed"  # deepspeed | megatron | torch
    static_loss_scale: float = 0.0  # > 0: a fixed scale (as DeepSpeed's loss_scale; 0 = dynamic)
    initial_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    hysteresis: int | None = None  # overflows tolerated before backing off (1 = none)
    consecutive_hysteresis: bool = False  # refill hysteresis after every clean step
    min_scale: float | None = None
    # Overflowing steps in a row at the minimum scale (or under a static scale) before the
    # run stops with an error naming the parameters whose gradients are not finite.
    max_overflows_at_min_scale: int = 3
    # bf16_pure: how an update smaller than a bf16 ulp still reaches the weight.
    update_rounding: str = "stochastic"  # stochastic | kahan
    # What gradients are reduced in across data-parallel ranks: None is the policy's own
    # (fp32 under fp16/bf16 mixed precision); fp32 | bf16 | fp16 to override.
    reduce_dtype: str | None = None
    # precision=fp8: how the GEMMs' fp8 inputs are scaled (llm/precision/fp8/): tensorwise
    # (one scale a tensor, torchao's default), rowwise (one a row, torchao's), deepseek
    # (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks, e4m3 throughout).
    fp8_recipe: str = "tensorwise"
    # Quantise and dequantise in fp32 (the recipe's rounding, not its speed): null picks it
    # where the real kernels cannot run (no fp8 tensor cores; torchao missing for tensorwise
    # and rowwise, triton for deepseek's GEMM of ours); false refuses to emulate.
    fp8_emulate: bool | None = None
    # Every k-th step, each fp8 linear records its operands' quantisation error and
    # saturation (llm.precision.fp8.record_fp8_stats) into summary.json's fp8_stats; 0: never.
    # Our fp8 linears only: torchao's Float8Linear records nothing.
    fp8_stats_every: int = 0

    def __post_init__(self) -> None:
        require_choice(
            "precision",
            "name",
            self.name,
            ("auto", "fp32", "tf32", "fp16", "bf16", "bf16_pure", "fp8"),
        )
        require_choice("precision", "loss_scaler", self.loss_scaler, LOSS_SCALER_PRESETS)
        require_choice(
            "precision", "fp8_recipe", self.fp8_recipe, ("tensorwise", "rowwise", "deepseek")
        )
        require_choice(
            "precision", "update_rounding", self.update_rounding, ("stochastic", "kahan")
        )
        require_positive(
            "precision",
            initial_scale=self.initial_scale,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_overflows_at_min_scale=self.max_overflows_at_min_scale,
        )
        if self.fp8_stats_every < 0:
            raise ConfigError(
                f"precision.fp8_stats_every={self.fp8_stats_every} must be >= 0 (0: never)"
            )
        if self.static_loss_scale < 0:
            raise ConfigError(
                f"precision.static_loss_scale={self.static_loss_scale} must be >= 0 (0: dynamic)"
            )
        if self.growth_factor is not None and self.growth_factor <= 1:
            raise ConfigError(f"precision.growth_factor={self.growth_factor} must be > 1")
        if self.backoff_factor is not None and not 0 < self.backoff_factor < 1:
            raise ConfigError(f"precision.backoff_factor={self.backoff_factor} must be in (0, 1)")
