"""Ours with the fast path on against transformers and torchtitan, on the same GPU in one
run: gpt2-small at 16 x 1024 tokens and llama-1b's layer shape, each eager and compiled;
tokens/s, MFU, the allocator's peak, the loss after the same steps on the same tokens, and
the top three kernels.

Each row runs in a fresh process (speed_rows.py; torchtitan's row: titan.py), so its peak
is its own. Ours runs the model, fused loss and attention pick the trainer builds, in a
step of its own (forward with the loss as head, backward, fused AdamW) rather than
llm/train's Trainer: the Trainer reads text through a tokenizer, not a token file every row
shares. MFU is the PaLM convention (llm.models.counting.flops_per_token) over the device's
dense bf16 peak (llm.train.metrics.lookup_peak_flops), as model_step.py computes it.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu_pass.common import (
    NOT_MEASURED,
    Goal,
    Result,
    deadline,
    device,
    earlier_rows,
    write_partial_rows,
)
from benchmarks.gpu_pass.speed_rows import (
    VOCAB_MULTIPLE,
    Row,
    in_fresh_process,
    run_row,
    write_tokens,
)
from benchmarks.gpu_pass.titan import titan_row
from llm.models import ModelArgs, model_args
from llm.models.counting import flops_per_token
from llm.train.metrics import lookup_peak_flops

LLM_C_TOKENS_PER_S = 470_000  # llm.c's GPT-2 124M per H100, rounded up (docs/references.md)
SPEEDUP_GOAL, LLAMA_MFU_GOAL = 1.3, 0.45
ROW_RESERVE_S = 60  # a compiled row: start-up, Inductor, steps and the profiled step
ANCHORS = [
    "anchor: llm.c, GPT-2 124M on 8 x H100, 140 ms per 524,288-token step: about 468,000 "
    "tokens/s per GPU, about 40% MFU (github.com/karpathy/llm.c/discussions/481)",
    "anchor: torchtitan, Llama 3.1 8B on 8 x H100 under FSDP, local batch 2, selective "
    "activation checkpointing: 5,762 tokens/s per GPU, 6,667 with torch.compile "
    "(github.com/pytorch/torchtitan/blob/main/docs/performance.md)",
]
DRY_NOTE = "dry run: CPU, compile off only, top ops by CPU self time; no allocator peak on CPU"
COLUMNS = ["shape", "layers", "impl", "compile", "attention", "loss_fn", "tokens_per_s",
           "mfu_pct", "peak_alloc_mib", "loss", "top_kernels"]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    name: str  # the registered shape
    batch: int
    seq_len: int
    n_layers: int | None = None  # None: the shape's own
    vocab_size: int | None = None  # None: the shape's own

    def args(self) -> ModelArgs:
        return model_args(
            self.name, n_layers=self.n_layers, vocab_size=self.vocab_size, max_seq_len=self.seq_len
        )


# llama-1b: its published vocabulary (128,256; conf/model/llama-1b.yaml takes the tokenizer's
# in runs) and 4 of its 16 layers, to keep each compile short. On an H200 (2026-11-28, an
# exploratory run from an uncommitted tree, no torchtitan) eight rows took 205 s: a compiled
# row 40-60 s, an eager one about 15 s, torchtitan's two about 50 s together.
# 4 x 2048 tokens peaked at 25 GB (transformers, eager): every row fits an H100's 80 GB.
GPU = {
    "gpt2": Shape("gpt2-small", 16, 1024),
    "llama": Shape("llama-1b", 4, 2048, n_layers=4, vocab_size=128256),
}
DRY = {"gpt2": Shape("gpt2-tiny", 2, 64), "llama": Shape("llama-tiny", 2, 64)}
STEPS = {False: (8, 3), True: (2, 1)}  # by dry: (timed, warm-up)
# The order rows start in: the pairs each goal needs first, so a row cut by the time limit
# costs the fewest goals. The dry run does not wait for Inductor: compile off only.
ORDER = [
    ("gpt2", "ours", True), ("gpt2", "transformers", True),
    ("llama", "ours", True), ("llama", "torchtitan", True),
    ("gpt2", "ours", False), ("gpt2", "transformers", False),
    ("llama", "ours", False), ("llama", "transformers", False), ("llama", "torchtitan", False),
    ("llama", "transformers", True),
]  # fmt: skip


def plan(dry: bool) -> list[tuple[str, str, bool]]:
    return [key for key in ORDER if not (dry and key[2])]


def _titan(shape: Shape, compile: bool, tokens_path: str, dry: bool, limit_s: float) -> dict:
    a = shape.args()
    steps, warmup = STEPS[dry]
    return titan_row(
        dim=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
        ffn_dim=a.d_ff, vocab_size=a.vocab_size, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
        batch=shape.batch, seq_len=shape.seq_len, steps=steps, warmup=warmup, compile=compile,
        tokens_path=tokens_path, dry=dry, limit_s=limit_s,
    )  # fmt: skip


def _ours_or_transformers(
    shape: Shape, impl: str, compile: bool, tokens_path: str, dry: bool
) -> dict:
    steps, warmup = STEPS[dry]
    row = Row(impl, compile, device(dry).type, shape.args(), shape.batch, shape.seq_len,
              steps, warmup, tokens_path)  # fmt: skip
    # The dry run keeps to its process: a fresh one per row costs its imports on a CPU.
    return run_row(row) if dry else in_fresh_process(row)


def _shape_cell(shape: Shape) -> str:
    return f"{shape.name} {shape.batch}x{shape.seq_len}"


def _key_of(row: dict) -> tuple[str, str, bool]:
    return row["shape"], row["impl"], row["compile"]


def table_row(key: tuple[str, str, bool], shape: Shape, got: dict, peak_flops) -> dict:
    _, impl, compile = key
    per_token = flops_per_token(shape.args(), shape.seq_len)
    tps, peak = got.get("tokens_per_s"), got.get("peak_alloc_bytes")
    kernels = got.get("top_kernels")
    return {
        "shape": _shape_cell(shape),
        "layers": shape.args().n_layers,
        "impl": impl,
        "compile": compile,
        "attention": got.get("attention", "-" if impl == "torchtitan" else "sdpa"),
        "loss_fn": got.get("fused_loss", "-" if impl == "torchtitan" else "fp32 logits"),
        "tokens_per_s": tps,
        "mfu_pct": None
        if tps is None or peak_flops is None
        else 100 * tps * per_token / peak_flops,
        "peak_alloc_mib": None if peak is None else peak / 2**20,
        "loss": got.get("loss"),
        "top_kernels": "; ".join(kernels) if kernels else None,
    }


def _find(rows: list[dict], family: str, impl: str, compile: bool) -> dict | None:
    shape = GPU[family].name
    return next(
        (r for r in rows
         if r["shape"].split()[0] in (shape, DRY[family].name)
         and r["impl"] == impl and r["compile"] == compile
         and r["tokens_per_s"] is not None),
        None,
    )  # fmt: skip


def _judged(met: bool, dry: bool) -> bool | None:
    return None if dry else met


def goals(rows: list[dict], dry: bool) -> list[Goal]:
    """Issue 39's goals on the rows that ran; each is not measured where a row it needs did
    not run or measured nothing (the notes say why). The dry run judges none."""
    out = []
    name = "gpt2-small tokens/s of ours, compile on"
    ours = _find(rows, "gpt2", "ours", True)
    target = f">= {LLM_C_TOKENS_PER_S:,} (llm.c's per-GPU rate)"
    if ours is None:
        out.append(Goal.unmeasured(name, target))
    else:
        tps = ours["tokens_per_s"]
        out.append(Goal(name, target, f"{tps:,.0f}", _judged(tps >= LLM_C_TOKENS_PER_S, dry)))
    for family in ("gpt2", "llama"):
        for compile in (False, True):
            label = f"{GPU[family].name} ours over transformers, compile {_on(compile)}"
            ours = _find(rows, family, "ours", compile)
            peer = _find(rows, family, "transformers", compile)
            if ours is None or peer is None:
                out.append(Goal.unmeasured(label, f">= {SPEEDUP_GOAL}x tokens/s"))
                continue
            ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
            met = _judged(ratio >= SPEEDUP_GOAL, dry)
            out.append(Goal(label, f">= {SPEEDUP_GOAL}x tokens/s", f"{ratio:.2f}x", met))
    for compile in (False, True):
        out += _llama_goals(rows, compile, dry)
    return out


def _llama_goals(rows: list[dict], compile: bool, dry: bool) -> list[Goal]:
    """The llama shape's MFU, and its tokens/s and peak against torchtitan's."""
    label = f"compile {_on(compile)}"
    mfu_goal = (f"llama-1b shape MFU of ours, {label}", f">= {LLAMA_MFU_GOAL:.0%}")
    titan_goal = (
        f"llama-1b shape ours against torchtitan, {label}",
        ">= 1.0x tokens/s with <= 1.0x peak memory",
    )
    ours = _find(rows, "llama", "ours", compile)
    titan = _find(rows, "llama", "torchtitan", compile)
    out = []
    if ours is None or ours["mfu_pct"] is None:
        why = NOT_MEASURED if ours is None else "no peak FLOP/s for this device"
        out.append(Goal(*mfu_goal, why, None))
    else:
        mfu = ours["mfu_pct"] / 100
        out.append(Goal(*mfu_goal, f"{mfu:.1%}", _judged(mfu >= LLAMA_MFU_GOAL, dry)))
    if ours is None or titan is None:
        out.append(Goal.unmeasured(*titan_goal))
        return out
    speed = ours["tokens_per_s"] / titan["tokens_per_s"]
    if ours["peak_alloc_mib"] is None or titan["peak_alloc_mib"] is None:
        value = f"{speed:.2f}x tokens/s; peak memory not measured"
        out.append(Goal(*titan_goal, value, None))
        return out
    memory = ours["peak_alloc_mib"] / titan["peak_alloc_mib"]
    met = _judged(speed >= 1.0 and memory <= 1.0, dry)
    out.append(Goal(*titan_goal, f"{speed:.2f}x tokens/s, {memory:.2f}x peak memory", met))
    return out


def _result(rows: list[dict], notes: list[str], dry: bool, peak_flops) -> Result:
    shapes = DRY if dry else GPU
    steps, warmup = STEPS[dry]
    described = "; ".join(
        f"{s.name} ({s.args().n_layers} layers, vocab {s.args().vocab_size:,}), batch "
        f"{s.batch} x {s.seq_len} tokens"
        for s in shapes.values()
    )
    peak = "-" if peak_flops is None else f"{peak_flops / 1e12:.0f} TFLOP/s"
    return Result(
        title="ours (fast path) against transformers and torchtitan, one GPU",
        shapes=(
            f"{described}; bf16 autocast, AdamW; median of {steps} timed steps after {warmup} "
            f"warm-up, every row on the same seeded token ids; loss: the mean token "
            f"cross-entropy of step {warmup + steps}'s batch; top kernels: one more step, "
            f"profiled, untimed; MFU: PaLM convention over {peak} bf16 peak"
        ),
        columns=COLUMNS,
        rows=rows,
        goals=goals(rows, dry),
        notes=notes + ANCHORS + ([DRY_NOTE] if dry else []),
    )


def _on(compile: bool) -> str:
    return "on" if compile else "off"


def _measure(key: tuple[str, str, bool], shape: Shape, tokens_path: str, dry: bool, left: float):
    """The row's figures; a row that fails (out of memory, a crash in its process) gives
    none, and its note says why, so the rows after it still run."""
    _, impl, compile = key
    try:
        if impl == "torchtitan":
            return _titan(shape, compile, tokens_path, dry, left)
        return _ours_or_transformers(shape, impl, compile, tokens_path, dry)
    except Exception as e:  # one row's failure is that row's result
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return {"note": f"failed: {type(e).__name__}: {first}"}


def _row_notes(key: tuple[str, str, bool], got: dict, said: set[str]) -> list[str]:
    """What a row says once: ours' attention and loss picks, torchtitan's note."""
    family, impl, compile = key
    lines = list(got.get("why", []))
    if got.get("note"):
        lines.append(f"{family} {impl}, compile {_on(compile)}: {got['note']}")
    fresh = [line for line in lines if line not in said]
    said.update(fresh)
    return fresh


def run(dry: bool) -> Result:
    device(dry)  # refuses the pass on a machine without a GPU
    peak_flops = lookup_peak_flops(torch.cuda.get_device_name() if not dry else "cpu", "bf16")
    shapes = DRY if dry else GPU
    steps, warmup = STEPS[dry]
    notes = [
        "ours: the repository's model, attention=auto's pick, the vocabulary padded to a "
        f"multiple of {VOCAB_MULTIPLE} (model.vocab_multiple; the padded logits -inf), eager with "
        "the fused loss the trainer hands the model as its head, compiled with the plain loss "
        "compiled too (transformers' likewise), "
        "torch's fused AdamW, in a step of this section's (not llm/train's Trainer, which reads "
        "text through a tokenizer); transformers: the same shape, sdpa, the same autocast and "
        "AdamW, fp32 cross-entropy of its logits"
    ]
    rows: list[dict] = []
    said: set[str] = set()
    # An earlier call's measured rows on this device (the runner's --resume, where speed's
    # files are unchanged since): kept, and not measured again.
    kept = {_key_of(r): r for r in earlier_rows() if r.get("tokens_per_s") is not None}
    if kept:
        notes.append(f"kept from an earlier record (--resume): {len(kept)} rows")
    stop_at = deadline(reserve_s=ROW_RESERVE_S)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = {}
        for family, shape in shapes.items():
            tokens[family] = str(Path(tmp) / f"{family}.npy")
            a = shape.args()
            write_tokens(tokens[family], a.vocab_size, steps + warmup, shape.batch, shape.seq_len)
        for key in plan(dry):
            family, impl, compile = key
            shape = shapes[family]
            if (done := kept.get((_shape_cell(shape), impl, compile))) is not None:
                rows.append(done)
                continue
            left = stop_at - time.monotonic()
            if left <= 0:
                notes.append(
                    f"{family} {impl}, compile {_on(compile)}: not run, past the time limit"
                )
                continue
            started = time.monotonic()
            got = _measure(key, shape, tokens[family], dry, left + ROW_RESERVE_S)
            # The row's whole wall time (start-up, compile, steps), kept in the JSON for the
            # section's time plan; not a column.
            rows.append(
                {**table_row(key, shape, got, peak_flops), "row_s": time.monotonic() - started}
            )
            notes += _row_notes(key, got, said)
            write_partial_rows(_result(rows, notes, dry, peak_flops))
    return _result(rows, notes, dry, peak_flops)
