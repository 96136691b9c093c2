"""Each optimizer's step time and state bytes against torch's fused AdamW
(benchmarks/optimizers.py's measurement: gpt2-medium, bf16 autocast, on the GPU); library
versions join where their package imports, and a row whose package is missing says so."""

from __future__ import annotations

import optimizers as bench

from benchmarks.gpu_pass.common import Result, device

PEER = "adamw (torch fused)"
GPU = {"model": "gpt2-medium", "batch": 4, "seq": 1024, "rounds": 3}
DRY = {"model": "gpt2-tiny", "batch": 1, "seq": 16, "rounds": 1}


def run(dry: bool) -> Result:
    s = DRY if dry else GPU
    dev = device(dry)
    measured, skipped, n_params = bench.measure(dev, s["model"], s["batch"], s["seq"], s["rounds"])
    peer = next((r for r in measured if r["optimizer"] == PEER), None)
    for r in measured:
        r["step_vs_fused_adamw"] = None if peer is None else r["step_ms"] / peer["step_ms"]
        r["train_vs_fused_adamw"] = (
            None if peer is None else r["train_step_ms"] / peer["train_step_ms"]
        )
    return Result(
        title=f"optimizers, {s['model']}, against torch's fused AdamW",
        shapes=(
            f"{s['model']} ({n_params / 1e6:.0f}M parameters), batch {s['batch']} x {s['seq']}, "
            f"bf16 autocast on CUDA, median of {s['rounds']} rounds; ratios are times over "
            "fused AdamW's (above 1: slower)"
        ),
        columns=["optimizer", "step_ms", "train_step_ms", "state_bytes_per_param",
                 "step_vs_fused_adamw", "train_vs_fused_adamw"],
        rows=measured,
        notes=[f"{row}: {why}" for row, why in skipped.items()],
    )  # fmt: skip
