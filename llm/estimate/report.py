"""The estimate as a rich table (exact bytes beside human-readable sizes) and as JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from llm.estimate.estimator import Estimate
from llm.estimate.inference import InferenceEstimate

# Column names of the per-stage table, short enough for an 80-column terminal.
SHORT = {
    "optimizer_states": "optimizer",
    "activations": "activ.",
    "stage_outputs": "outputs",
    "gathered_weights": "gathered",
}

# The table's title names the moment its rows are, when it is not the end of forward.
PEAK_AT = {"backward": "peak early in backward", "optimizer_step": "peak in the optimizer step"}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def count(n: float) -> str:
    """A parameter count as people write it: 176.28B, 124.44M, 416.77K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{int(n)}"


def estimate_table(est: Estimate, title: str) -> Table:
    table = Table(title=title)
    per_rank = "per rank" if est.stages is None else f"rank {est.rank} (largest stage)"
    names = (per_rank, "bytes", "size", "host (offloaded)") + (("nvme",) if est.disk else ())
    for name in names:
        table.add_column(name, justify="left" if name == per_rank else "right")
    blank = ("",) * (len(names) - 3)
    if est.peak_moment != "forward":  # the rows shown are the moment the total is
        table.title = f"{title} ({PEAK_AT[est.peak_moment]})"
    for row, value in est.peak_rows.items():
        elsewhere = [est.host.get(row, 0)] + ([est.disk.get(row, 0)] if est.disk else [])
        table.add_row(row, f"{value:,}", human(value), *(human(n) if n else "" for n in elsewhere))
    verdict = "fits" if est.fits else "does NOT fit"
    table.add_row("total", f"{est.total:,}", human(est.total), *blank, style="bold")
    table.add_row(
        f"device memory ({verdict})", f"{est.device_memory:,}", human(est.device_memory), *blank
    )
    table.add_row("communication / step", f"{est.comm_bytes:,}", human(est.comm_bytes), *blank)
    return table


def stages_table(est: Estimate) -> Table:
    """Every pipeline rank's rows (at estimate.rank's dp and tp coordinate), the largest
    marked: the rank that sets the peak."""
    rows = list(dict.fromkeys(r for stage in est.stages for r in stage.device))
    table = Table(title="per pipeline stage (rank), MiB")
    for name in ("stage", "rank", *(SHORT.get(r, r) for r in rows), "total"):
        table.add_column(name, justify="right", no_wrap=True)
    for stage in est.stages:
        largest = stage.rank == est.rank
        table.add_row(
            str(stage.pp_rank),
            str(stage.rank),
            *(_mib(stage.device.get(r, 0)) for r in rows),
            _mib(stage.total),
            style="bold" if largest else None,
        )
    return table


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def largest_stage(est: Estimate) -> str:
    stage = next(s for s in est.stages if s.rank == est.rank)
    return f"largest: pipeline stage {stage.pp_rank} (rank {stage.rank}) sets the peak"


def inference_table(est: InferenceEstimate, title: str) -> Table:
    """One tp rank's weights, KV cache and working memory, the total against the device,
    and the largest batch and longest context that fit."""
    table = Table(title=title)
    for name in (f"tp rank {est.tp_rank} of {est.tp}", "bytes", "size"):
        table.add_column(name, justify="left" if name.startswith("tp") else "right")
    for row, value in est.device.items():
        table.add_row(row, f"{value:,}", human(value))
    verdict = "fits" if est.fits else "does NOT fit"
    table.add_row("total", f"{est.total:,}", human(est.total), style="bold")
    table.add_row(f"device memory ({verdict})", f"{est.device_memory:,}", human(est.device_memory))
    per_seq = est.kv_bytes_per_token * est.context
    table.add_row("KV cache / token", f"{est.kv_bytes_per_token:,}", human(est.kv_bytes_per_token))
    table.add_row(f"KV cache / sequence of {est.context:,}", f"{per_seq:,}", human(per_seq))
    table.add_row(f"largest batch at context {est.context:,}", f"{est.max_batch:,}", "")
    longest = f"{est.max_context:,}" + (
        " (max_seq_len)" if est.max_context == est.max_seq_len else ""
    )
    table.add_row(f"longest context at batch {est.batch:,}", longest, "")
    return table


def print_estimate(est: Estimate, title: str, console: Console | None = None) -> None:
    console = console or Console()
    console.print(estimate_table(est, title))
    if est.stages is not None:
        console.print(stages_table(est))
        console.print(largest_stage(est))
