"""precision=fp8's three recipes against bf16 autocast on a llama-shaped stack, each as a run
converts its model (llm.precision.apply_fp8, the output head kept in bf16): tensorwise and
rowwise on torchao's Float8Linear, deepseek on our Triton GEMM (1x128 / 128x128 scales,
llm/precision/fp8/triton_gemm.py). Per recipe: step time, tokens/s, the peak of allocated
memory over the timed steps, and the loss over the same steps from the same weights on the
same batch. All compiled (torchao's scaling ops are meant to be fused; our GEMM runs outside
the compiled graph, as our FlashAttention does).

Each recipe needs a GPU with fp8 tensor cores, and torchao (tensorwise, rowwise) or triton
(deepseek); a recipe that cannot run, or fails, is a note saying why, and the others go on.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benchmarks.gpu_pass.common import Result, device
from benchmarks.timing import median_ms
from llm.errors import ConfigError
from llm.memory import cuda_peak_bytes, reset_cuda_peak
from llm.models import build_model, materialize, model_args
from llm.precision import apply_fp8, resolve_precision

# llama-1b's widths are multiples of 128 (d_model 2048, kv 512, d_ff 8192): every recipe runs.
GPU = {"model": "llama-1b", "layers": 2, "batch": 8, "seq_len": 2048, "steps": 10, "compile": True}
DRY = {
    "model": "llama-tiny", "layers": 2, "batch": 2, "seq_len": 64, "steps": 3, "compile": False,
    "shape": {"d_model": 128, "n_kv_heads": 4, "d_ff": 384},
}  # fmt: skip
RECIPES = ("tensorwise", "rowwise", "deepseek")
GEMM = {"tensorwise": "torchao", "rowwise": "torchao", "deepseek": "ours (Triton)"}


def _train(model, batch, steps: int, compiled: bool, dev) -> tuple[list[float], float]:
    """Losses of ``steps`` AdamW steps on one batch, then the median step time (ms)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    run = torch.compile(model) if compiled else model
    inputs, targets = batch

    def step() -> torch.Tensor:
        with torch.autocast(dev.type, torch.bfloat16):
            logits = run(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step().item() for _ in range(steps)]
    return losses, median_ms(step, warmup=0, min_run_time=0.5 if dev.type == "cuda" else 0.05)


def _row(name: str, gemm: str, model, batch, s: dict, dev) -> dict:
    reset_cuda_peak(dev, empty_cache=True)
    losses, ms = _train(model, batch, s["steps"], s["compile"], dev)
    peak = cuda_peak_bytes(dev)
    return {
        "recipe": name, "gemm": gemm, "step_ms": ms,
        "tokens_per_s": s["batch"] * s["seq_len"] / ms * 1e3,
        "peak_gib": None if peak is None else peak / 2**30,
        "first_loss": losses[0], "last_loss": losses[-1],
    }  # fmt: skip


def run(dry: bool) -> Result:
    s, dev = (DRY if dry else GPU), device(dry)
    args = model_args(
        s["model"], n_layers=s["layers"], max_seq_len=s["seq_len"], **s.get("shape", {})
    )
    base = materialize(build_model(args), dev, seed=0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab_size, (s["batch"], s["seq_len"] + 1), generator=g).to(dev)
    batch = (data[:, :-1], data[:, 1:])
    rows, notes = [_row("bf16", "-", copy.deepcopy(base), batch, s, dev)], []
    for recipe in RECIPES:
        try:
            # The dry run emulates (the code path, not the speed); the pass refuses to.
            policy = resolve_precision("fp8", dev, fp8_recipe=recipe, fp8_emulate=dry or False)
            model = apply_fp8(copy.deepcopy(base), policy)
            gemm = "emulated" if policy.fp8_emulated else GEMM[recipe]
            rows.append(_row(recipe, gemm, model, batch, s, dev))
        except (ConfigError, RuntimeError) as e:  # one recipe's failure leaves the others
            notes.append(f"{recipe}: not run: {str(e).splitlines()[0]}")
        torch.compiler.reset()
    bf16 = rows[0]
    for row in rows[1:]:
        row["speedup"] = bf16["step_ms"] / row["step_ms"]
        row["loss_diff"] = row["last_loss"] - bf16["last_loss"]
    return Result(
        title=f"fp8 recipes (torchao tensorwise, rowwise; our deepseek GEMM) against bf16, "
        f"{s['model']}-shaped stack",
        shapes=(
            f"{s['model']} shape with {s['layers']} layers, batch {s['batch']} x {s['seq_len']}, "
            f"{s['steps']} AdamW steps on one batch, compile {'on' if s['compile'] else 'off'}"
        ),
        columns=["recipe", "gemm", "step_ms", "tokens_per_s", "peak_gib", "first_loss",
                 "last_loss", "speedup", "loss_diff"],
        rows=rows,
        notes=notes,
    )  # fmt: skip
