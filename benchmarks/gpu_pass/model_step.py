"""One training step of gpt2-small at 1024 tokens, ours against transformers' GPT-2, with
torch.compile off and on: tokens/s, MFU and the CUDA allocator's peak.

The step and its timing are benchmarks/step_vs_transformers.py's (each row in a fresh
process; forward, fp32 cross-entropy, backward, AdamW; bf16 autocast). MFU is the PaLM
convention (llm.models.counting.flops_per_token: 6N + 12·L·T·d_attn per token, attention
FLOPs included and every score counted, causal or not) over the device's dense bf16 peak
(llm.train.metrics.PEAK_FLOPS).
"""

from __future__ import annotations

import time

import step_vs_transformers as svt
import torch

from benchmarks.gpu_pass.common import Goal, Result, deadline, device, write_partial_rows
from llm.models import model_args
from llm.models.counting import flops_per_token
from llm.train.metrics import lookup_peak_flops

MFU_GOAL, SPEEDUP_GOAL = 0.50, 1.3
GPU = {"model": "gpt2-small", "batch": 16, "seq_len": 1024, "steps": 10, "warmup": 3}
DRY = {"model": "gpt2-tiny", "batch": 2, "seq_len": 64, "steps": 2, "warmup": 1}
COMPILES = {False: (False, True), True: (False,)}  # by dry: the dry run does not wait for Inductor


def _rows(dry: bool) -> list[svt.Row]:
    s = DRY if dry else GPU
    dev = device(dry).type
    args = model_args(s["model"], max_seq_len=s["seq_len"])
    return [
        svt.Row(impl, "sdpa", "bf16", comp, dev, args, s["batch"], s["seq_len"],
                s["steps"], s["warmup"], None)
        for comp in COMPILES[dry]
        for impl in svt.IMPLS
    ]  # fmt: skip


def _goals(rows: list[dict], dry: bool) -> list[Goal]:
    """MFU and the speed-up over transformers for each compile setting the section runs;
    not measured where the row (or the pair) did not run (the notes say why)."""
    goals = []
    for comp in COMPILES[dry]:
        got = {r["impl"]: r for r in rows if r["compile"] == comp}
        label = f"compile {'on' if comp else 'off'}"
        mfu_goal = (f"MFU of ours, {label}", f">= {MFU_GOAL:.0%}")
        speed_goal = (f"tokens/s of ours over transformers', {label}", f">= {SPEEDUP_GOAL}x")
        ours = got.get("ours")
        if ours is None:
            goals.append(Goal.unmeasured(*mfu_goal))
        elif ours["mfu_pct"] is None:
            goals.append(Goal(*mfu_goal, "no peak FLOP/s for this device", None))
        else:
            mfu = ours["mfu_pct"] / 100
            goals.append(Goal(*mfu_goal, f"{mfu:.1%}", None if dry else mfu >= MFU_GOAL))
        if ours is None or "transformers" not in got:
            goals.append(Goal.unmeasured(*speed_goal))
            continue
        speedup = ours["tokens_per_s"] / got["transformers"]["tokens_per_s"]
        met = None if dry else speedup >= SPEEDUP_GOAL
        goals.append(Goal(*speed_goal, f"{speedup:.2f}x", met))
    return goals


def _result(out: list[dict], notes: list[str], per_token: float, peak, dry: bool) -> Result:
    s = DRY if dry else GPU
    return Result(
        title=f"training step, {s['model']}, ours against transformers",
        shapes=(
            f"{s['model']}, batch {s['batch']} x {s['seq_len']} tokens, bf16 autocast, sdpa, "
            f"AdamW; median of {s['steps']} steps after {s['warmup']} warm-up; MFU: PaLM "
            f"convention, {per_token / 1e6:.0f} MFLOP/token (attention included, all scores "
            f"counted) over {'-' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'} bf16 peak"
        ),
        columns=["impl", "compile", "median_ms", "tokens_per_s", "mfu_pct", "peak_alloc_mib",
                 "params"],
        rows=out,
        goals=_goals(out, dry),
        notes=notes + (["dry run: compile off only; no allocator peak on CPU"] if dry else []),
    )  # fmt: skip


def run(dry: bool) -> Result:
    rows = _rows(dry)
    s = DRY if dry else GPU
    per_token = flops_per_token(rows[0].args, s["seq_len"])
    peak = lookup_peak_flops(torch.cuda.get_device_name() if not dry else "cpu", "bf16")
    out, notes = [], []
    stop_at = deadline(reserve_s=60)  # a compiled row takes about a minute
    for row in rows:
        if time.monotonic() > stop_at:
            notes.append(f"{row.impl}, compile {row.compile}: not run, past the time limit")
            continue
        (r,) = svt.measure([row], rounds=1)
        out.append({
            "impl": r["impl"],
            "compile": r["compile"],
            "median_ms": r["median_ms"],
            "tokens_per_s": r["tokens_per_s"],
            "mfu_pct": None if peak is None else 100 * r["tokens_per_s"] * per_token / peak,
            "peak_alloc_mib": r["peak_mib"] if not dry else None,
            "params": r["params"],
        })  # fmt: skip
        write_partial_rows(_result(out, notes, per_token, peak, dry))
    return _result(out, notes, per_token, peak, dry)
