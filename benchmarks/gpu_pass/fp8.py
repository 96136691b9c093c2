"""torchao float8 training (precision=fp8: dynamic per-tensor scales, the output head kept in
bf16, as llm.precision.apply_fp8 converts a run's model) against bf16 autocast, on a
llama-shaped stack: step time, tokens/s, and the loss over the same steps from the same
weights on the same batch. Both compiled (torchao's scaling ops are meant to be fused).

Needs torchao and a GPU with fp8 tensor cores; elsewhere the fp8 row says why it did not run.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benchmarks.gpu_pass.common import Result, device, time_ms
from llm.errors import ConfigError
from llm.models import build_model, materialize, model_args
from llm.precision import apply_fp8, resolve_precision

GPU = {"model": "llama-1b", "layers": 2, "batch": 8, "seq_len": 2048, "steps": 20, "compile": True}
DRY = {"model": "llama-tiny", "layers": 2, "batch": 2, "seq_len": 64, "steps": 3, "compile": False}


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
    return losses, time_ms(step, warmup=0, min_run_time=0.5 if dev.type == "cuda" else 0.05)


def run(dry: bool) -> Result:
    s, dev = (DRY if dry else GPU), device(dry)
    args = model_args(s["model"], n_layers=s["layers"], max_seq_len=s["seq_len"])
    base = materialize(build_model(args), dev, seed=0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab_size, (s["batch"], s["seq_len"] + 1), generator=g).to(dev)
    batch = (data[:, :-1], data[:, 1:])
    rows, notes = [], []
    for name in ("bf16", "fp8"):
        model = copy.deepcopy(base)
        if name == "fp8":
            try:
                model = apply_fp8(model, resolve_precision("fp8", dev, fp8_emulate=False))
            except ConfigError as e:
                notes.append(f"fp8: not run: {e}")
                continue
        losses, ms = _train(model, batch, s["steps"], s["compile"], dev)
        rows.append({
            "precision": name, "step_ms": ms, "tokens_per_s": s["batch"] * s["seq_len"] / ms * 1e3,
            "first_loss": losses[0], "last_loss": losses[-1],
        })  # fmt: skip
    if len(rows) == 2:
        rows[1]["speedup"] = rows[0]["step_ms"] / rows[1]["step_ms"]
        rows[1]["loss_diff"] = rows[1]["last_loss"] - rows[0]["last_loss"]
    return Result(
        title=f"fp8 (torchao float8) against bf16, {s['model']}-shaped stack",
        shapes=(
            f"{s['model']} shape with {s['layers']} layers, batch {s['batch']} x {s['seq_len']}, "
            f"{s['steps']} AdamW steps on one batch, compile {'on' if s['compile'] else 'off'}"
        ),
        columns=["precision", "step_ms", "tokens_per_s", "first_loss", "last_loss", "speedup",
                 "loss_diff"],
        rows=rows,
        notes=notes,
    )  # fmt: skip
