"""Opt-in record of how much each fp8 GEMM operand loses to quantisation, and how often it
saturates, per linear layer; off by default (an Fp8Linear's ``stats`` is None), on inside
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
Totals = dict[str, Tensor]  # calls, rel_error_sum, rel_error_max, saturated, underflowed, elements


@dataclass
class Fp8Stats:
    """Per (layer, operand), summed over every recorded call: relative L2 error of the
    dequantised operand against the tensor it was cast from; elements saturated (past the
    format's maximum, clamped), underflowed (nonzero, cast to zero: a group's scale too
    coarse for them, e.g. gradients under DeepSeek's amax floor of 1e-4) and in all.
    For DeepSeek's ``input_t`` that tensor is the dequantised forward copy (the
    requantisation alone; the forward cast is under ``input``)."""

    totals: dict[tuple[str, str], Totals] = field(default_factory=dict)

    def layer(self, name: str) -> LayerStats:
        """A recorder that files every call under layer ``name``."""
        return LayerStats(self, name)

    @torch.no_grad()
    def record(self, layer: str, operand: str, original: Tensor, q: Quantized) -> None:
        x = original.float()
        err = (q.dequantize() - x).norm() / x.norm().clamp(min=torch.finfo(torch.float32).tiny)
        one = {
            "calls": torch.ones((), device=x.device),
            "rel_error_sum": err,
            "rel_error_max": err,
            "saturated": q.saturated.to(x.device, torch.float32),
            "underflowed": ((q.data == 0) & (x != 0)).sum().float(),
            "elements": torch.tensor(float(x.numel()), device=x.device),
        }
        # Device tensors summed as they come: no host sync per GEMM, one in the summaries.
        key = (layer, operand)
        self.totals[key] = _merge(self.totals[key], one) if key in self.totals else one

    def summary(self) -> dict[str, dict[str, float | str]]:
        """{operand: row} over every layer (row: see :func:`_row`)."""
        merged: dict[str, Totals] = {}
        for (_, operand), t in self.totals.items():
            merged[operand] = _merge(merged[operand], t) if operand in merged else t
        return {operand: _row(operand, t) for operand, t in sorted(merged.items())}

    def by_layer(self) -> dict[str, dict[str, dict[str, float | str]]]:
        """{layer: {operand: row}}."""
        out: dict[str, dict[str, dict[str, float | str]]] = {}
        for (layer, operand), t in sorted(self.totals.items()):
            out.setdefault(layer, {})[operand] = _row(operand, t)
        return out


@dataclass(frozen=True)
class LayerStats:
    """What an Fp8Linear records into: its :class:`Fp8Stats` and its own name."""

    stats: Fp8Stats
    name: str

    def record(self, operand: str, original: Tensor, q: Quantized) -> None:
        self.stats.record(self.name, operand, original, q)


def _merge(a: Totals, b: Totals) -> Totals:
    out = {key: a[key] + b[key] for key in a if key != "rel_error_max"}
    out["rel_error_max"] = torch.maximum(a["rel_error_max"], b["rel_error_max"])
    return out


def _row(operand: str, t: Totals) -> dict[str, float | str]:
    """kind, calls, mean_rel_error, max_rel_error, saturated, saturated_fraction,
    underflowed, underflowed_fraction."""
    calls, saturated, under = t["calls"].item(), t["saturated"].item(), t["underflowed"].item()
    return {
        "kind": OPERAND_KIND[operand],
        "calls": calls,
        "mean_rel_error": t["rel_error_sum"].item() / calls,
        "max_rel_error": t["rel_error_max"].item(),
        "saturated": saturated,
        "saturated_fraction": saturated / t["elements"].item(),
        "underflowed": under,
        "underflowed_fraction": under / t["elements"].item(),
    }
