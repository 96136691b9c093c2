"""Our dynamic loss scaler (Micikevicius et al., 2018), with the DeepSpeed, Megatron-LM and
torch presets of docs/references.md.

fp16 gradients of small losses underflow; multiplying the loss by ``scale`` before backward
lifts them into range, and dividing the gradients by it before the step undoes that. When
a gradient overflows (inf/nan) the step is skipped and the scale backs off; after
``growth_interval`` clean steps it grows again. Hysteresis tolerates a few overflows before
backing off (DeepSpeed's ``delayed_shift``, Megatron's ``hysteresis``).

The scaler only keeps the arithmetic: strategies detect overflow across every rank and
shard (one all-reduce of the squared gradient norm: inf/nan anywhere makes it non-finite)
and call :meth:`LossScaler.update`. A disabled scaler (fp32, bf16) has scale 1 and still
skips non-finite steps, so a NaN gradient never reaches the weights under any precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm.config import PrecisionConfig

# docs/references.md, "Mixed precision and loss scaling". torch's GradScaler has no hysteresis and no
# floor; min_scale 0 means none. growth_offset is no config field: it is how each library
# counts, and a preset is only faithful with its own (see LossScalerSettings).
_HALVE_OR_DOUBLE = dict(growth_factor=2.0, backoff_factor=0.5)  # all three agree on these
PRESETS: dict[str, dict[str, float]] = {
    "deepspeed": dict(
        _HALVE_OR_DOUBLE,
        initial_scale=2.0**16,
        growth_interval=1000,
        hysteresis=2,
        min_scale=1.0,
        growth_offset=1,
    ),
    "megatron": dict(
        _HALVE_OR_DOUBLE, initial_scale=2.0**32, growth_interval=1000, hysteresis=2, min_scale=1.0
    ),
    "torch": dict(
        _HALVE_OR_DOUBLE, initial_scale=2.0**16, growth_interval=2000, hysteresis=1, min_scale=0.0
    ),
}


@dataclass
class LossScalerSettings:
    initial_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 1
    min_scale: float = 0.0
    # Clean steps after the start or an overflow before the growth window starts counting.
    # DeepSpeed grows when (steps since the last overflow - 1) is a positive multiple of
    # the window, one step later than Megatron-LM and torch's GradScaler (offset 0).
    growth_offset: int = 0
    consecutive_hysteresis: bool = False
    dynamic: bool = True
    max_overflows_at_min_scale: int = 3

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> LossScalerSettings:
        preset = PRESETS[cfg.loss_scaler]
        chosen = {
            k: v if getattr(cfg, k, None) is None else getattr(cfg, k) for k, v in preset.items()
        }
        if cfg.static_loss_scale > 0:
            chosen["initial_scale"] = cfg.static_loss_scale
        return cls(
            **chosen,
            consecutive_hysteresis=cfg.consecutive_hysteresis,
            dynamic=cfg.static_loss_scale == 0,
            max_overflows_at_min_scale=cfg.max_overflows_at_min_scale,
        )


class LossScaler:
    """``scale_loss`` before backward; ``update(found_inf)`` once per optimizer step."""

    def __init__(self, settings: LossScalerSettings, enabled: bool = True) -> None:
        self.settings = settings
        self.enabled = enabled
        self.scale = float(self.settings.initial_scale)
        self._growth_tracker = 0  # clean steps since the start or the last overflow
        self._hysteresis_left = self.settings.hysteresis
        self.overflows_at_min_scale = 0  # consecutive
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    @property
    def at_min_scale(self) -> bool:
        return not self.settings.dynamic or self.scale <= self.settings.min_scale

    @property
    def gave_up(self) -> bool:
        """True when the scale cannot go lower and overflows keep coming: stop the run."""
        return self.overflows_at_min_scale >= self.settings.max_overflows_at_min_scale

    def update(self, found_inf: bool) -> None:
        s = self.settings
        if found_inf:
            self.skipped_steps += 1
            self.overflows_at_min_scale = (
                self.overflows_at_min_scale + 1 if self.at_min_scale else 0
            )
            if not s.dynamic:
                return
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * s.backoff_factor, s.min_scale)
            return
        self.overflows_at_min_scale = 0
        if not s.dynamic:
            return
        if s.consecutive_hysteresis:
            self._hysteresis_left = s.hysteresis
        self._growth_tracker += 1
        counted = self._growth_tracker - s.growth_offset
        if counted > 0 and counted % s.growth_interval == 0:
            self._hysteresis_left = s.hysteresis
            self.scale *= s.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
            "overflows_at_min_scale": self.overflows_at_min_scale,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.overflows_at_min_scale = int(state["overflows_at_min_scale"])
        self.skipped_steps = int(state["skipped_steps"])


def build_loss_scaler(cfg: PrecisionConfig, loss_scaling: bool) -> LossScaler:
    """The configured dynamic/static scaler when the policy scales losses (fp16), else a
    disabled one that still guards against non-finite gradients."""
    if loss_scaling:
        return LossScaler(LossScalerSettings.from_config(cfg))
    return disabled_loss_scaler(cfg.max_overflows_at_min_scale)


def disabled_loss_scaler(max_overflows_at_min_scale: int = 3) -> LossScaler:
    """A static scale of 1 that only counts (and skips) non-finite steps."""
    settings = LossScalerSettings(
        dynamic=False, max_overflows_at_min_scale=max_overflows_at_min_scale
    )
    return LossScaler(settings, enabled=False)
