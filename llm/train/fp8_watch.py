"""The trainer's side of precision.fp8_stats_every: every k-th step's micro-batches run with
each fp8 linear recording its operands' quantisation error and saturation
(llm.precision.fp8.record_fp8_stats), summed over the recorded steps into the summary's
``fp8_stats`` ({layer: {operand: row}}, this rank's layers)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn

from llm.precision.fp8 import Fp8Linear, Fp8Stats, record_fp8_stats


class Fp8Watch:
    def __init__(self, model: nn.Module, every: int) -> None:
        self.model = model
        # torchao's Float8Linear and non-fp8 runs have no linear of ours to record.
        self.every = every if any(isinstance(m, Fp8Linear) for m in model.modules()) else 0
        self.asked = every > 0
        self.stats = Fp8Stats()

    def recording(self, step: int) -> AbstractContextManager:
        if self.every and step % self.every == 0:
            return record_fp8_stats(self.model, self.stats)
        return nullcontext()

    def summary(self) -> dict:
        if not self.asked:
            return {}
        if not self.every:
            return {
                "fp8_stats": None,
                "fp8_stats_note": "not recorded: precision.fp8_stats_every reads our fp8 "
                "linears (precision=fp8 emulated or precision.fp8_recipe=deepseek), and this "
                "run has none",
            }
        return {"fp8_stats": self.stats.by_layer() or None}
