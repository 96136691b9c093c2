"""What the peak-memory tracker costs a training step: the default model's step (forward,
cross-entropy, backward, AdamW) with tracking on and off, alternated in one process so that
load from anything else on the machine falls on both alike.

    python benchmarks/tracker_cost.py                    # gpt2-mini, batch 16 x 256, CPU
    python benchmarks/tracker_cost.py --pairs 20 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llm.memory import PeakTracker, module_state_tensors
from llm.models import build_model, materialize, model_args


def _step(model, opt, tracker, x, y, tracked: bool) -> tuple[float, float]:
    """One step; returns (wall seconds, process CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    with tracker.step(tracked):
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        tracker.phase("backward")
        tracker.watch_backward(loss)
        loss.backward()
        tracker.phase("optimizer_step")
        opt.step()
        opt.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-mini")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    a = parser.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    args = model_args(a.model, vocab_size=4096)
    model = materialize(build_model(args), device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = PeakTracker(device, "alternate")
    tracker.watch(lambda: module_state_tensors(model, opt))
    x = torch.randint(0, args.vocab_size, (a.batch, a.seq), device=device)
    y = torch.randint(0, args.vocab_size, (a.batch, a.seq), device=device)
    for tracked in (True, False):  # warm-up: optimizer states, allocator, first-call costs
        _step(model, opt, tracker, x, y, tracked)
    times = {True: [], False: []}
    for i in range(2 * a.pairs):
        tracked = i % 2 == 0
        times[tracked].append(_step(model, opt, tracker, x, y, tracked))
    on, off = ([statistics.median(t[k] for t in times[m]) for k in (0, 1)] for m in (True, False))
    print(f"{a.model} batch {a.batch}x{a.seq} on {device.type}, {a.pairs} pairs (medians)")
    print(
        f"  wall: on {on[0] * 1e3:,.0f} ms  off {off[0] * 1e3:,.0f} ms  +{on[0] / off[0] - 1:.1%}"
    )
    print(
        f"  cpu:  on {on[1] * 1e3:,.0f} ms  off {off[1] * 1e3:,.0f} ms  +{on[1] / off[1] - 1:.1%}"
    )
    print(f"  peak: {tracker.best_step}")


if __name__ == "__main__":
    main()
