"""Each optimizer's step time (the optimizer step alone, and a whole training step: forward,
cross-entropy, backward, step) and its state bytes per parameter, ours side by side with
library versions of the same algorithm, in one process.

    python benchmarks/optimizers.py                  # gpt2-small shape, fp32, CPU
    python benchmarks/optimizers.py --device cuda    # gpt2-medium, bf16 autocast, GPU
                                                     # (adds torch's fused AdamW and
                                                     # DeepSpeed's FusedLamb)

Rows are measured in rounds (every optimizer once per round, the median over rounds), so
load from anything else on the machine falls on all of them alike. The optimizer-step rows
step on fixed random gradients; Sophia's row is its step without the Hessian estimate
(its extra forward and backward every k steps is in the training-step column, divided by k).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.timing import one_call_s
from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.memory import optimizer_state_tensors, storage_bytes
from llm.models import build_model, materialize, model_args
from llm.optim import OPTIMIZERS, build_optimizer, param_groups

# conf/optimizer/*.yaml's hyperparameters matter little to speed; each row uses its name's.
OURS = ("adamw", "adafactor", "lamb", "lion", "sophia", "muon", "adamw8bit", "sgd")


def _library(name: str, model, device) -> torch.optim.Optimizer | None:
    """The library version compared with our row ``name``, or None where there is none."""
    groups = param_groups(model, 0.1)
    if name == "lamb (pytorch-optimizer)":
        from pytorch_optimizer import Lamb

        return Lamb(groups, lr=1e-3, weight_decouple=False, adam_debias=True)
    if name == "lion (lion-pytorch)":
        from lion_pytorch import Lion

        return Lion(groups, lr=1e-4)
    if name == "adamw (torch fused)":
        return torch.optim.AdamW(groups, lr=3e-4, fused=True)
    if name == "adafactor (torch)":
        return torch.optim.Adafactor(groups, lr=1e-2)
    if name == "lamb (DeepSpeed FusedLamb)" and device.type == "cuda":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb(groups, lr=1e-3)
    return None


def _rows(device: torch.device) -> list[str]:
    rows = [*OURS, "lamb (pytorch-optimizer)", "lion (lion-pytorch)", "adafactor (torch)"]
    rows.append("adamw (torch fused)")
    if device.type == "cuda":
        rows.append("lamb (DeepSpeed FusedLamb)")
    return rows


def _optimizer(row: str, model, device) -> torch.optim.Optimizer:
    if row in OPTIMIZERS:
        return build_optimizer(model, OptimizerConfig(name=row))
    return _library(row, model, device)


def _matmul_ms(d: int, dtype: torch.dtype, device) -> float:
    """One (d x 4d) @ (4d x d) product: the Gram matrix of an MLP weight in Newton-Schulz."""
    a = torch.randn(d, 4 * d, device=device, dtype=dtype)
    b = a.T.contiguous()
    a @ b
    return 1e3 * one_call_s(lambda: a @ b)


def _muon_skip_reason(d: int, device) -> str | None:
    """Why the default CPU run leaves Muon out, or None: torch.optim.Muon runs its Newton-Schulz
    iteration in bfloat16 (hard-coded), and a CPU without bf16 matrix units (no AVX512-BF16 or
    AMX) multiplies bf16 far slower than fp32; at gpt2-small one step then takes hours."""
    if device.type != "cpu":
        return None
    d = min(d, 384)  # the ratio, not the time, decides; a full-size bf16 probe takes a minute
    fp32, bf16 = _matmul_ms(d, torch.float32, device), _matmul_ms(d, torch.bfloat16, device)
    if bf16 < 10 * fp32:
        return None
    return (
        f"not run: this CPU multiplies bf16 {bf16 / fp32:.0f}x slower than fp32 ({bf16:.0f} "
        f"against {fp32:.1f} ms for {d}x{4 * d} @ {4 * d}x{d}), and torch.optim.Muon's "
        "Newton-Schulz runs in bf16; name it in --rows to run it anyway"
    )


def _unavailable(row: str, model, device) -> str | None:
    """Why ``row`` cannot run here (a package missing), or None."""
    try:
        _optimizer(row, model, device)
    except (ImportError, ConfigError) as e:
        return f"not run: {str(e).splitlines()[0]}"
    return None


def measure(device: torch.device, name: str, batch: int, seq: int, rounds: int, rows=None):
    """Each row's median step-alone and training-step seconds and state bytes per parameter:
    (rows measured, {row: why it was not run}, parameter count)."""
    args = model_args(name)
    model = materialize(build_model(args), device, seed=0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    x = torch.randint(0, args.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, args.vocab_size, (batch, seq), device=device)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    n_params = sum(p.numel() for p in model.parameters())
    initial = [p.detach().clone() for p in model.parameters()]

    def reset() -> None:
        with torch.no_grad():
            for p, v in zip(model.parameters(), initial, strict=True):
                p.copy_(v)

    def train_step(opt, step: int) -> None:
        extra = getattr(opt, "gradient_pass", None)
        if extra is not None and extra.due(step):
            with autocast:
                logits = model(x)
            extra.loss(logits, y, x, seed=step).div(y.numel()).backward()
            extra.consume(torch.tensor(float(y.numel()), device=device))
            opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    asked, rows = rows, _rows(device) if rows is None else list(rows)
    skipped = {}
    if asked is None and (reason := _muon_skip_reason(args.d_model, device)) is not None:
        skipped["muon"] = reason
    for row in rows:
        if row not in skipped and (reason := _unavailable(row, model, device)) is not None:
            skipped[row] = reason
    rows = [r for r in rows if r not in skipped]
    step_s: dict[str, list[float]] = {r: [] for r in rows}
    train_s: dict[str, list[float]] = {r: [] for r in rows}
    state: dict[str, float] = {}
    for round_ in range(1, rounds + 1):
        for row in rows:
            reset()
            opt = _optimizer(row, model, device)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            opt.step()  # the state is made lazily: the first step is not timed
            step_s[row].append(one_call_s(opt.step))
            opt.zero_grad(set_to_none=True)
            k = getattr(opt, "hessian_every", 1)
            # k training steps, so Sophia's row pays its Hessian estimate once, as it does
            # every k steps in a run.
            train_s[row].append(
                sum(one_call_s(lambda s=s, o=opt: train_step(o, s)) for s in range(1, k + 1)) / k
            )
            state[row] = storage_bytes(optimizer_state_tensors(opt)) / n_params
            del opt
            # Progress on stderr (the table comes at the end): a CPU round takes minutes.
            print(
                f"round {round_}/{rounds} {row}: step alone {1e3 * step_s[row][-1]:.0f} ms, "
                f"training step {1e3 * train_s[row][-1]:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    measured = [
        {
            "optimizer": row,
            "step_ms": 1e3 * statistics.median(step_s[row]),
            "train_step_ms": 1e3 * statistics.median(train_s[row]),
            "state_bytes_per_param": state[row],
        }
        for row in rows
    ]
    return measured, skipped, n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="gpt2-small on CPU, gpt2-medium on GPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default=None, help="comma-separated rows (default: all)")
    a = parser.parse_args()
    device = torch.device(a.device)
    name = a.model or ("gpt2-medium" if device.type == "cuda" else "gpt2-small")
    rows = None if a.rows is None else a.rows.split(",")
    measured, skipped, n_params = measure(device, name, a.batch, a.seq, a.rounds, rows)
    print(
        f"{name} ({n_params / 1e6:.1f}M parameters), batch {a.batch} x {a.seq}, {device}, "
        f"median of {a.rounds} rounds"
    )
    print("| optimizer | step alone (ms) | training step (ms) | state bytes / param |")
    print("|---|---:|---:|---:|")
    for r in measured:
        print(
            f"| {r['optimizer']} | {r['step_ms']:.0f} | {r['train_step_ms']:.0f} | "
            f"{r['state_bytes_per_param']:.2f} |"
        )
    for row, reason in skipped.items():
        print(f"| {row} | {reason} | | |")


if __name__ == "__main__":
    main()
