"""Counted collective payloads (``comm_bytes_per_step``) in the ZeRO paper's units: elements
each rank moves per step, divided by Φ (Rajbhandari et al., section 7). An all-reduce counts
twice its payload (a reduce-scatter plus an all-gather), so DDP's payload of Φ is the
paper's 2Φ."""

from __future__ import annotations

from llm.precision import PrecisionPolicy


def comm_itemsize(kind: str, p: PrecisionPolicy) -> int:
    """Bytes per element of a collective: parameters are gathered in working_dtype, and
    every strategy reduces gradients in reduce_dtype (DDP's comm hook, our ZeRO, FSDP2's
    MixedPrecisionPolicy, DeepSpeed's communication_data_type)."""
    return (p.working_dtype if kind in ("all_gather", "broadcast") else p.reduce_dtype).itemsize


def comm_phi(sent: dict[str, float], p: PrecisionPolicy, phi: int) -> float:
    elements = 0.0
    for kind, payload in sent.items():
        count = payload / comm_itemsize(kind, p)
        elements += 2 * count if kind == "all_reduce" else count
    return elements / phi
