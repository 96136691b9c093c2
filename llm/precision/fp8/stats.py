"""Opt-in record of how much each fp8 GEMM operand loses to quantisation, and how often it
saturates; off by default (an Fp8Linear's ``stats`` is None), on inside
:func:`~llm.precision.fp8.linear.record_fp8_stats`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from llm.precision.fp8.scaling import Quantized

# The operand of each GEMM: output = input @ weight^T; grad_input = grad_output @ weight_t;
# grad_weight = grad_output_t^T @ input_t (the _t ones are cast along the token dimension).
OPERAND_KIND = {
    "input": "activation",
    "input_t": "activation",
    "weight": "weight",
    "weight_t": "weight",
    "grad_output": "gradient",
    "grad_output_t": "gradient",
}


@dataclass
class Fp8Stats:
    """Per operand, summed over every recorded call: relative L2 error of the dequantised
    operand against the tensor it was cast from, saturated and total elements. For
    DeepSeek's ``input_t`` that tensor is the dequantised forward copy (the requantisation
    alone; the forward cast is under ``input``)."""

    totals: dict[str, dict[str, Tensor]] = field(default_factory=dict)

    @torch.no_grad()
    def record(self, operand: str, original: Tensor, q: Quantized) -> None:
        x = original.float()
        err = (q.dequantize() - x).norm() / x.norm().clamp(min=torch.finfo(torch.float32).tiny)
        t = self.totals.setdefault(operand, {})
        # Device tensors summed as they come: no host sync per GEMM, one in summary().
        for key, value in (
            ("calls", torch.ones((), device=x.device)),
            ("rel_error_sum", err),
            ("saturated", q.saturated.to(x.device, torch.float32)),
            ("elements", torch.tensor(float(x.numel()), device=x.device)),
        ):
            t[key] = t[key] + value if key in t else value
        worst = t.get("rel_error_max")
        t["rel_error_max"] = err if worst is None else torch.maximum(worst, err)

    def summary(self) -> dict[str, dict[str, float | str]]:
        """{operand: {kind, calls, mean_rel_error, max_rel_error, saturated,
        saturated_fraction}}."""
        out: dict[str, dict[str, float | str]] = {}
        for operand, t in sorted(self.totals.items()):
            calls, saturated = t["calls"].item(), t["saturated"].item()
            out[operand] = {
                "kind": OPERAND_KIND[operand],
                "calls": calls,
                "mean_rel_error": t["rel_error_sum"].item() / calls,
                "max_rel_error": t["rel_error_max"].item(),
                "saturated": saturated,
                "saturated_fraction": saturated / t["elements"].item(),
            }
        return out
