"""What a rank says when a collective times out: one line naming the collective, the
timeout (``launcher.timeout_min``, the process group's) and where NCCL's flight recorder
dumped every rank's last collectives.

The launcher turns the recorder on for every run (llm.launch.launcher.enable_flight_recorder:
TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE =
``<run>/nccl_trace_rank_``, unless the user set them: torch appends the rank). Two ways a timeout ends a rank:

- gloo (and NCCL's blocking calls) raise in the collective's Python call: ``RuntimeError``
  "Timed out waiting ...ms for recv operation"; the innermost torch.distributed frame names
  the collective (``collective_timeout``);
- NCCL's watchdog finds a collective past its timeout on its own thread, writes the dumps
  and aborts the process (SIGABRT); the launcher then reads the dumps and names the
  collective each rank was in (``waiting_in``).
"""

from __future__ import annotations

import pickle
import re
import traceback
from pathlib import Path

# In the run directory itself: torch writes the dump files, not a folder for them.
TRACE_PREFIX = "nccl_trace_rank_"  # torch appends the rank: nccl_trace_rank_0, ...
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def trace_prefix(run_dir: Path) -> Path:
    return Path(run_dir) / TRACE_PREFIX


def read_command(prefix: Path) -> str:
    """torch's reader of every rank's dump (``prefix``: TORCH_FR_DUMP_TEMP_FILE)."""
    prefix = Path(prefix)
    return (
        f"python -m torch.distributed.flight_recorder.fr_trace {prefix.parent} "
        f"--prefix {prefix.name}"
    )


def collective_timeout(
    exc: BaseException, rank: int, timeout_min: float, prefix: Path
) -> str | None:
    """The one line for ``exc`` when it is a collective's timeout, else None."""
    if not isinstance(exc, RuntimeError) or not _TIMEOUT.search(str(exc)):
        return None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _in_torch_distributed(f)]
    if not frames:
        return None
    collective = frames[-1].name  # the innermost: all_reduce, broadcast, barrier, ...
    said = str(exc).strip().splitlines()[0]
    said = said.split("] ", 1)[1] if said.startswith("[") and "] " in said else said
    return (
        f"rank {rank}: collective {collective} timed out ({said}; launcher.timeout_min="
        f"{timeout_min:g}): another rank did not reach it, or was in another collective; "
        f"on NCCL every rank's last collectives are dumped to {prefix}N (read them with "
        f"{read_command(prefix)}); raise launcher.timeout_min if a rank is only slow"
    )


def waiting_in(prefix: Path) -> str | None:
    """ "rank 0 in nccl:all_reduce #12, rank 1 in nccl:broadcast #12": the oldest collective
    each rank that dumped to ``prefix``N had not completed, or None when none dumped."""
    found = []
    prefix = Path(prefix)
    for path in sorted(prefix.parent.glob(f"{prefix.name}*")):
        rank = path.name.removeprefix(prefix.name)
        try:
            entries = pickle.loads(path.read_bytes())["entries"]
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError):
            continue
        open_ = [e for e in entries if e.get("state") != "completed"]
        if rank.isdigit() and open_:
            e = open_[0]
            found.append((int(rank), f"{e['profiling_name']} #{e['collective_seq_id']}"))
    return ", ".join(f"rank {r} in {what}" for r, what in sorted(found)) or None


def _in_torch_distributed(frame: traceback.FrameSummary) -> bool:
    return frame.filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")
