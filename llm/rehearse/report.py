"""What a rehearsal reports: this rank's tracked peak by category (and on CUDA the
allocator's), its step time without communication, and the bytes each collective would
have moved; as a rich table and as JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from llm.estimate.report import human

CATEGORIES = ("params", "grads", "optimizer_states", "activations", "other", "total")


def rehearsal_figures(summary: dict, world_size: int, rank: int) -> dict:
    """The figures of llm.run's summary that belong to the rehearsed rank (its per-rank
    lists hold this rank's value for every rank: the fake group carries no other's)."""
    cuda = summary.get("cuda_max_allocated_bytes")
    return {
        "world_size": world_size,
        "rank": rank,
        "layout": {
            key: summary[key]
            for key in ("strategy", "dp_size", "tp_size", "pp_size", "ep_size", "precision")
        },
        "model": summary["model"],
        "n_params": summary["n_params"],
        "device": summary["device"],
        "steps": summary["steps"],
        "memory_peak": summary["memory_peak"][0],
        "memory_peak_by_phase": summary["memory_peak_by_phase"][0],
        "cuda_max_allocated_bytes": None if cuda is None else cuda[0],
        "model_state_bytes": summary["model_state_bytes"][0],
        "step_time_s": summary["step_time_s"],
        "comm_bytes_per_step": summary["comm_bytes_per_step"][0],
        "memory_peak_tensors": (summary.get("memory_peak_tensors") or [None])[0],
    }


def print_rehearsal(figures: dict) -> None:
    console = Console()
    lay = figures["layout"]
    peak = figures["memory_peak"]
    table = Table(
        title=f"{figures['model']} rank {figures['rank']} of {figures['world_size']}: "
        f"{lay['strategy']} dp={lay['dp_size']} tp={lay['tp_size']} ep={lay['ep_size']} "
        f"{lay['precision']} on {figures['device']} (peak in {peak['phase']})"
    )
    table.add_column("category")
    table.add_column("at the step's peak", justify="right")
    table.add_column("most in a step", justify="right")
    for name in CATEGORIES:
        most = peak.get(f"{name}_max")
        table.add_row(name, human(peak[name]), "" if most is None else human(most))
    if figures["cuda_max_allocated_bytes"] is not None:
        table.add_row("allocator (cuda)", human(figures["cuda_max_allocated_bytes"]), "")
    console.print(table)
    if figures["memory_peak_tensors"]:
        print_peak_tensors(console, figures["memory_peak_tensors"])
    comm = Table(title="bytes each collective would move per step (payload, not ring traffic)")
    comm.add_column("collective")
    comm.add_column("bytes", justify="right")
    for kind, n in sorted(figures["comm_bytes_per_step"].items()):
        comm.add_row(kind, human(n))
    console.print(comm)
    step = figures["step_time_s"]
    console.print(
        "compute time per step, no communication: "
        + ("no timed step (raise rehearse.steps)" if step is None else f"{step:.3f} s")
    )


def print_peak_tensors(console: Console, tensors: dict) -> None:
    """train.peak_tensors' list: the largest tensors live at the step's peak."""
    table = Table(title="the largest tensors at the step's peak (train.peak_tensors)")
    table.add_column("#", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("category")
    table.add_column("made by")
    for i, t in tensors.items():
        table.add_row(i, human(t["bytes"]), t["category"], t["made_by"])
    console.print(table)
