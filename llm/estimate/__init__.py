"""Memory and cost estimates before a run: activations from the shape (the Korthikanti
formula redone for our blocks), model states by strategy and precision, communication per
step, and a plan of what fits (``python -m llm.estimate``)."""

from llm.estimate.activations import (
    PAPER,
    ActivationEstimate,
    Kernels,
    estimate_activations,
    layer_terms,
    outside_terms,
)

__all__ = [
    "PAPER",
    "ActivationEstimate",
    "Kernels",
    "estimate_activations",
    "layer_terms",
    "outside_terms",
]
