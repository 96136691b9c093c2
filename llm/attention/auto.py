"""``attention=auto``: the fastest backend the committed GPU measurements show for this
device, dtype, head dim, mask and sequence length, among those that can run here.

The rule (docs/attention.md, "attention=auto"):

- The device's measurements: llm/attention/choices.json (built from docs/gpu_pass by
  ``python -m llm.attention.choose``), the entry for this CUDA device's name, else one with
  the same compute capability (the same architecture, e.g. H100 and H200 are both 9.0).
- The shape: the measured rows of the same dtype and mask; of those, the nearest head dim,
  then the nearest T, each on a log2 scale, a tie going to the larger.
- The backend: the first of that shape's backends, fastest forward+backward first, that
  :func:`~llm.attention.registry.check_kernel` accepts here (installed, and supporting this
  dtype, head dim, grouped K/V, dropout and mask), so a winner that cannot run gives way to
  the next.
- Otherwise sdpa with torch's own pick (``FALLBACK``), with the reason: on CPU, sdpa is
  what the CPU measurements support (docs/benchmarks.md, "Attention backends": it saves
  O(B·T) for backward against eager's O(B·T²), and torch picks its flash kernel there; the
  CPU timings are too noisy to rank kernels by), and a device, dtype or mask no record
  measured has nothing to rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from llm.attention.registry import check_kernel, kernel_name
from llm.errors import ConfigError

TABLE = Path(__file__).with_name("choices.json")  # python -m llm.attention.choose writes it
FALLBACK = ("sdpa", "auto")
CPU_REASON = (
    "no GPU here: sdpa, torch's pick (its flash kernel on CPU), saves O(T) for backward where "
    "eager saves O(T^2); the CPU timings do not rank kernels (docs/benchmarks.md)"
)


@dataclass(frozen=True)
class Device:
    type: str  # cpu | cuda
    name: str | None = None  # torch.cuda.get_device_name
    capability: str | None = None  # "9.0"

    @classmethod
    def of(cls, device: torch.device) -> Device:
        if device.type != "cuda" or not torch.cuda.is_available():
            return cls(device.type)
        major, minor = torch.cuda.get_device_capability(device)
        return cls("cuda", torch.cuda.get_device_name(device), f"{major}.{minor}")

    def __str__(self) -> str:
        return self.type if self.name is None else f"{self.name} ({self.capability})"


@dataclass(frozen=True)
class Choice:
    backend: str
    kernel: str  # attention.sdpa_kernel; "auto" for every backend but sdpa
    requested: str  # the configured attention.backend
    why: str  # one line: what was asked and where the answer comes from

    def summary(self) -> dict[str, str]:
        return {
            "requested": self.requested,
            "backend": self.backend,
            "sdpa_kernel": self.kernel,
            "why": self.why,
        }


@cache
def load_table() -> dict:
    return json.loads(TABLE.read_text())


def _entry(table: dict, device: Device) -> tuple[dict | None, str]:
    """The device's measurements and how they were matched, or None and why not."""
    if device.type != "cuda":
        return None, CPU_REASON
    entries = table["devices"]
    for e in entries:
        if e["device"] == device.name:
            return e, ""
    for e in entries:
        if e["capability"] == device.capability:
            return e, f" (measured on {e['device']}, the same compute capability)"
    return None, f"no committed GPU record for {device}"


def _nearest(values: set[int], want: int) -> int:
    return min(values, key=lambda v: (abs(math.log2(v / want)), -v))


def _shape(entry: dict, dtype: str, head_dim: int, mask: str, seq_len: int) -> dict | None:
    rows = [s for s in entry["shapes"] if (s["dtype"], s["mask"]) == (dtype, mask)]
    if not rows:
        return None
    d = _nearest({s["head_dim"] for s in rows}, head_dim)
    t = _nearest({s["seq_len"] for s in rows if s["head_dim"] == d}, seq_len)
    return next(s for s in rows if (s["head_dim"], s["seq_len"]) == (d, t))


def resolve(
    backend: str,
    kernel: str,
    *,
    device: Device,
    dtype: torch.dtype,
    head_dim: int,
    seq_len: int,
    document_mask: bool,
    gqa: bool,
    dropout: bool,
    training: bool = True,
    table: dict | None = None,
) -> Choice:
    """The backend and sdpa kernel to build with: the configured ones, or for ``auto`` the
    rule above (``table``: choices.json unless given)."""
    if backend != "auto":
        return Choice(backend, kernel, backend, "named in the config")
    dt, mask = str(dtype).removeprefix("torch."), "documents" if document_mask else "causal"
    asked = f"{device}, {dt}, head dim {head_dim}, {mask}, T={seq_len}"

    def fallback(reason: str) -> Choice:
        return Choice(
            *FALLBACK, "auto", f"attention=auto on {asked}: {kernel_name(*FALLBACK)}: {reason}"
        )

    entry, matched = _entry(load_table() if table is None else table, device)
    if entry is None:
        return fallback(matched)
    shape = _shape(entry, dt, head_dim, mask, seq_len)
    if shape is None:
        return fallback(f"{entry['record']} measured no {dt} {mask} attention")
    source = (
        f"row D={shape['head_dim']} T={shape['seq_len']} {shape['dtype']} {mask} of "
        f"{entry['record']} ({entry['commit']}){matched}"
    )
    skipped = []
    for name, tflops in shape["ranked"]:
        b, _, k = name.partition(":")
        k = k or "auto"
        try:
            check_kernel(
                b, k, device=device.type, dtype=dtype, head_dim=head_dim, gqa=gqa,
                dropout=dropout, document_mask=document_mask, training=training,
            )  # fmt: skip
        except ConfigError as e:
            skipped.append(f"{name} cannot run here ({e})")
            continue
        rank = "fastest" if not skipped else "fastest that runs here"
        why = "; ".join([f"{rank}, {tflops:g} TFLOP/s fwd+bwd, {source}", *skipped])
        return Choice(b, k, "auto", f"attention=auto on {asked}: {kernel_name(b, k)}: {why}")
    return fallback(f"no backend measured in {source} runs here: {'; '.join(skipped)}")


def resolve_for(
    attention: Any, args: Any, *, device: torch.device, dtype: torch.dtype, seq_len: int
) -> Choice:
    """:func:`resolve` for a run: ``attention`` its AttentionConfig, ``args`` its ModelArgs,
    ``dtype`` what attention sees (the compute dtype)."""
    return resolve(
        attention.backend,
        attention.sdpa_kernel,
        device=Device.of(device),
        dtype=dtype,
        head_dim=args.head_dim,
        seq_len=seq_len,
        document_mask=attention.document_mask,
        gqa=args.n_kv_heads != args.n_heads,
        dropout=args.dropout > 0,
    )
