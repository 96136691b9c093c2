"""What a failed local rank tells the launcher: one line for the user, and the traceback.

Each rank that fails writes ``<run>/.rank_errors/rank{r}.txt``: the line, then the
traceback when the error was not one of our one-line errors. The launcher reports the
rank that failed first (by file time: later failures are usually ranks losing their peer),
which is the cause the user must see, not "rank N exited with code 1".
"""

from __future__ import annotations

from pathlib import Path

from llm.parallel.hangs import read_command, waiting_in


def record_rank_failure(directory: Path, rank: int, line: str, trace: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.txt").write_text(line + ("\n" + trace if trace else ""))


def rank_failure(
    directory: Path,
    rank: int,
    exit_code: int,
    signal_name: str | None,
    trace_prefix: str | None = None,
) -> str:
    """One line for the failure that stopped the run. ``rank`` is the first one the
    launcher saw exit: when a signal killed it (not our SIGTERM) and it left no record, that
    is the cause, and other ranks' records are about losing it; else the earliest record in
    ``directory``; else what the exit says. A SIGABRT with flight-recorder dumps at
    ``trace_prefix``N is NCCL's watchdog ending a timed-out collective: the line names the
    collective each rank was in."""
    killed = signal_name not in (None, "SIGTERM") and not (directory / f"rank{rank}.txt").exists()
    reports = (
        [] if killed else sorted(directory.glob("rank*.txt"), key=lambda p: p.stat().st_mtime_ns)
    )
    if reports:
        first = reports[0]
        line, _, trace = first.read_text().partition("\n")
        return f"{line} (traceback: {first})" if trace else line
    if signal_name == "SIGABRT" and trace_prefix and (where := waiting_in(Path(trace_prefix))):
        return (
            f"rank {rank} was aborted by NCCL's watchdog: a collective timed out "
            f"(launcher.timeout_min) with {where}; every rank's last collectives are in "
            f"{trace_prefix}N ({read_command(Path(trace_prefix))})"
        )
    if signal_name:
        return (
            f"rank {rank} was killed by {signal_name} before it could report an error "
            "(SIGKILL is often the out-of-memory killer: check dmesg, and lower "
            "train.micro_batch_size or launcher.nproc_per_node)"
        )
    return (
        f"rank {rank} exited with code {exit_code} without an error message; see its output above"
    )
