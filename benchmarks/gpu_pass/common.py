"""What every section shares: its result (rows, goals, notes) and the device; timing is
benchmarks/timing.py's."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.gpu_pass.provenance import write_module_files

NOT_MEASURED = "not measured"


@dataclass
class Goal:
    """A target the issue sets; ``met`` is None where it is not judged (``value`` says why:
    NOT_MEASURED where nothing it needs was measured). A goal is never met on no figures."""

    name: str
    target: str
    value: str
    met: bool | None

    @classmethod
    def unmeasured(cls, name: str, target: str) -> Goal:
        return cls(name, target, NOT_MEASURED, None)


@dataclass
class Result:
    """One section's figures: a table (``columns`` name the keys of each row), its goals and
    notes (what was skipped and why)."""

    title: str
    shapes: str
    columns: list[str]
    rows: list[dict]
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def device(dry: bool) -> torch.device:
    """CUDA for the pass, CPU for the dry run; the pass on a machine without a GPU is refused."""
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("the GPU pass needs a CUDA device; on a CPU run it with --dry")
    return torch.device("cuda")


LIMIT_ENV = "GPU_PASS_SECTION_LIMIT_S"
PARTIAL_ENV = "GPU_PASS_PARTIAL_JSON"
EARLIER_ENV = "GPU_PASS_EARLIER_JSON"
OUT_ENV = "GPU_PASS_OUT"  # the pass's --out: files a section writes beside the record


def earlier_rows() -> list[dict]:
    """The rows an earlier call on the same device already measured for this section (the
    runner's ``--resume``, passed in GPU_PASS_EARLIER_JSON); empty without one. A section
    that sweeps keeps them and measures only the rest."""
    path = os.environ.get(EARLIER_ENV)
    if not path:
        return []
    with open(path) as f:
        return [{**row, "earlier": True} for row in json.load(f)]


def write_partial_rows(result: Result) -> None:
    """Write the rows so far, and the files imported so far, where the runner reads them if
    the section runs out of time (GPU_PASS_PARTIAL_JSON); a no-op outside the runner."""
    path = os.environ.get(PARTIAL_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result.to_json(), f)
        os.replace(tmp, path)  # never a half-written file
        write_module_files()


def deadline(reserve_s: float) -> float:
    """When a sweeping section stops starting rows: its process limit (the runner passes it
    in GPU_PASS_SECTION_LIMIT_S) less ``reserve_s`` for the row in flight and the write-up,
    and at least half the limit."""
    limit = float(os.environ.get(LIMIT_ENV, "600"))
    return time.monotonic() + max(limit - reserve_s, limit / 2)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What every figure carries: the device, torch, CUDA, Triton and the date."""
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"CPU ({platform.processor() or 'cpu'})",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton") or _version("pytorch-triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def fmt(value, spec: str = ".1f") -> str:
    """A table cell: numbers formatted, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value != 0 and abs(value) < 1:
        return f"{value:.2g}"  # errors and fractions keep two significant digits
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format(value, spec)
    return str(value)
