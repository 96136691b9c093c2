"""The estimate as a rich table (exact bytes beside human-readable sizes) and as JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from llm.estimate.estimator import Estimate


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def estimate_table(est: Estimate, title: str) -> Table:
    table = Table(title=title)
    for name in ("per rank", "bytes", "size", "host (offloaded)"):
        table.add_column(name, justify="left" if name == "per rank" else "right")
    for row, value in est.device.items():
        host = est.host.get(row, 0)
        table.add_row(row, f"{value:,}", human(value), human(host) if host else "")
    verdict = "fits" if est.fits else "does NOT fit"
    table.add_row("total", f"{est.total:,}", human(est.total), "", style="bold")
    table.add_row(
        f"device memory ({verdict})", f"{est.device_memory:,}", human(est.device_memory), ""
    )
    table.add_row("communication / step", f"{est.comm_bytes:,}", human(est.comm_bytes), "")
    return table


def print_estimate(est: Estimate, title: str, console: Console | None = None) -> None:
    (console or Console()).print(estimate_table(est, title))
