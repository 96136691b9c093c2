"""Host reads on the step's path: calls that make the host wait for a tensor's value,
counted with a TorchFunctionMode, each with the line of this repository that made it."""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
_TOOL = Path(__file__).resolve().parent
# Each reaches __torch_function__ (tests/test_profile_step.py checks every one on CPU).
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
# A copy to the host waits for the device too; on CPU it is no read.
DEVICE_READS = ("cpu",)
_READS = {getattr(torch.Tensor, name): name for name in READS}
_DEVICE_READS = {getattr(torch.Tensor, name): name for name in DEVICE_READS}


def _in_repo(path: Path) -> bool:
    """Our code: under the repository, not its virtualenv, and not this tool."""
    if not path.is_relative_to(REPO) or path.is_relative_to(_TOOL):
        return False
    return not path.relative_to(REPO).parts[0].startswith(".")


def _where(frame) -> tuple[str, str]:
    """(the first frame of our code that led to the read, the innermost frame outside the
    tool when that is another's: a torch function our line called)."""
    via = ""
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if _in_repo(path):
            return f"{path.relative_to(REPO)}:{frame.f_lineno}", via
        if not via and not path.is_relative_to(_TOOL):
            via = f"{path.name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside this repository", via


class HostReads(TorchFunctionMode):
    """Counts (where, via, what) of each host read while active."""

    def __init__(self) -> None:
        super().__init__()
        # (where, via, what, the tensor's device type): a read of a CPU tensor does not
        # wait for a GPU.
        self.counts: Counter[tuple[str, str, str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _READS.get(func)
        if what is None and func in _DEVICE_READS and args[0].device.type != "cpu":
            what = _DEVICE_READS[func]
        if what is not None:
            where = _where(inspect.currentframe().f_back)
            self.counts[(*where, what, args[0].device.type)] += 1
        return func(*args, **(kwargs or {}))

    def rows(self, steps: int) -> list[dict]:
        """One row per (where, via, what, device), most frequent first, with its count
        per step."""
        return [
            {
                "where": w,
                "via": via,
                "what": what,
                "tensor_on": dev,
                "count": n,
                "per_step": n / steps,
            }
            for (w, via, what, dev), n in self.counts.most_common()
        ]
