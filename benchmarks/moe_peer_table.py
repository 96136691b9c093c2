"""The table "MoE: ours vs DeepSpeed-MoE" (benchmarks/moe_peer.py's rows): its columns, cells,
title and legend, and the optimizer-state bytes a rank should hold when both sides shard
each expert slice over its expert data-parallel (edp) group."""

from __future__ import annotations

import argparse

MB = 1e6

# Optimizer-state bytes per parameter element in fp32, the one precision --moe-peer runs:
# ours is AdamW's two fp32 moments; DeepSpeed's ZeRO keeps its fp32 master partition beside
# them even when the working weights are fp32 (the O of its rows, as of the deepspeed2 rows).
OPTIMIZER_BYTES = {"ours": 8, "deepspeed": 12}


def expected_optimizer_bytes(
    dense: int, experts: int, ranks: int, ep: int, per_element: int
) -> float:
    """The optimizer-state bytes of one rank under ZeRO when the dense parameters are cut
    over all ``ranks`` and each rank's expert slice (``experts`` / ep elements: every MoE
    layer's E / ep experts) over its edp = ranks / ep ranks, as DeepSpeed-MoE cuts them.
    Bucket and partition padding (a few elements) is not counted."""
    edp = ranks // ep
    return per_element * (dense / ranks + experts / ep / edp)


def side(impl: str) -> str:
    """Whose optimizer layout a row's impl runs: "ours" or "deepspeed"."""
    return "ours" if impl == "ours" else "deepspeed"


COLUMNS = (
    "ranks / ep",
    "MoE layers",
    "median step ms",
    "vs ours",
    "others' CPU",
    "all-to-all MB / step, per rank",
    "DeepSpeed formula MB, per rank (capacity C per layer)",
    "O MB per rank (expected)",
    "step peak MB, per rank",
    "rank 0 peak MB (P/G/O/A/other, phase)",
    "loss step 1",
    "loss",
)

LEGEND = (
    "MoE table: ours = train.py model=moe-tiny parallelism=zero2 parallelism.ep_size=ep; "
    "deepspeed-moe = the same model with deepspeed.moe.layer.MoE(ep_size=ep) feed-forwards, "
    "deepspeed.initialize ZeRO-2 (same init, data, optimizer, schedule; expert params in "
    "their own groups, so ZeRO cuts their optimizer state over the edp = ranks / ep group). "
    "all-to-all: bytes a rank sends to the other ranks of its ep group per step (forward and "
    "backward); DeepSpeed formula: 4 (ep-1)/ep E C d x 4 B summed over layers, C from "
    "DeepSpeed's capacity rule (drop_tokens=False: the ep group's largest expert count; "
    "capacity_factor=E/k: the rank's tokens); O: each rank's most optimizer-state bytes in "
    "its peak step, expected b x (dense / ranks + local experts / edp) with b = 8 B (ours: "
    "AdamW's moments) or 12 B (DeepSpeed: + its fp32 master); step peak: the peak tracker's "
    "live tensor bytes (P params, G grads, O optimizer states, A activations); loss: "
    "training loss after the timing pass's steps."
)


def _per_rank(values: list[float]) -> str:
    return " / ".join(f"{v / MB:.2f}" for v in values)


def _formula(r: dict) -> str:
    if "formula_a2a_bytes_per_rank" not in r:
        return "- (rows sent: routing)"
    caps = sorted({c for rank in r["capacities"] for step in rank for c in step})
    return f"{_per_rank(r['formula_a2a_bytes_per_rank'])} (C {', '.join(map(str, caps))})"


def _optimizer_states(r: dict) -> str:
    held = [p["optimizer_states_max"] for p in r["memory_peak"]]
    return f"{_per_rank(held)} ({r['expected_optimizer_bytes'] / MB:.2f})"


def cells(r: dict, ours: dict | None) -> list[str]:
    import strategy_runs as runs

    head = [f"{r['ranks']} / {r['ep']}", r["label"]]
    if not r["ok"]:
        return [*head, f"failed: {r['error']}", *[""] * (len(COLUMNS) - 3)]
    vs = f"{r['median_ms'] / ours['median_ms']:.2f}x" if ours and ours.get("ok") else "-"
    return [
        *head,
        f"{r['median_ms']:.0f}",
        vs,
        f"{r['others_cpu']:.2f}",
        _per_rank(r["a2a_bytes_per_rank"]),
        _formula(r),
        _optimizer_states(r),
        _per_rank(r["peak_bytes_per_rank"]),
        runs.peak_cells(r["memory_peak"][0]),
        f"{r['losses'][0]:.4f}",
        f"{r['losses'][-1]:.4f}",
    ]


def table_rows(rows: list[dict]) -> list[list[str]]:
    ours = {(r["ranks"], r["ep"]): r for r in rows if r["impl"] == "ours"}
    return [cells(r, ours.get((r["ranks"], r["ep"]))) for r in rows]


def title(a: argparse.Namespace, rows: list[dict]) -> str:
    import strategy_runs as runs

    counts = sorted({r["ranks"] for r in rows})
    threads = ", ".join(f"{runs.threads_per_rank(a, n)} at {n} ranks" for n in counts)
    return (
        f"MoE: ours vs DeepSpeed-MoE; {a.moe_model}, global batch {a.global_batch} x seq "
        f"{a.moe_seq_len} ({a.tokenizer} tokens), {a.precision}, {a.device}, ep as the first "
        f"column says (edp = ranks / ep), median of steps {a.warmup + 1}-{a.steps}, "
        f"all-to-all and peaks over {a.measure_steps} measured steps, threads per rank "
        f"{threads}; {runs.machine(rows)}"
    )
