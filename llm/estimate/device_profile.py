"""A device's measured rates for the plan's time model: ``estimate.device=NAME``.

``cuda`` (the default) and ``cpu`` keep the nominal model (every matmul at
``estimate.flops_per_s``). A NAME with a profile in conf/device/ (``h200.yaml``, written by
the GPU pass's calibrate section, benchmarks/gpu_pass/calibrate.py), or a path to such a
``.yaml``, prices each matmul at the TFLOP/s the device reached at that shape and attention
at its kernel's TFLOP/s at that head dim and length; both interpolated linearly in the log of
every axis between measured points and held at the edge value beyond them. A GPU in
NOMINAL_BF16_TFLOPS with no profile of its own takes another profile's rates scaled by the
ratio of the two nominal peaks, and says so (``DeviceProfile.note``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llm.errors import ConfigError

PROFILES = Path(__file__).resolve().parents[2] / "conf" / "device"
FORMAT = 1
NOMINAL_KERNELS = ("cuda", "cpu")  # estimate.device values that keep the nominal model
# Dense bf16 tensor-core peaks, TFLOP/s, without sparsity (NVIDIA's datasheets: H100 SXM,
# H200 SXM, A100 SXM and PCIe; docs/references.md).
NOMINAL_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0}
# Which measured kernel stands for the estimator's attention backend: SDPA and flash_attn
# run FlashAttention's algorithm on CUDA, xformers its memory-efficient kernel; the others
# (triton, flex, eager) have no figure of their own and take flash's.
ATTENTION_KERNEL = {"sdpa": "flash", "flash_attn": "flash", "xformers": "efficient"}


def interpolate(axes: list[list[float]], grid: list, point: list[float]) -> float:
    """Multilinear interpolation of ``grid`` (nested lists over ``axes``) at ``point``, in
    the log of each axis; a coordinate beyond an axis takes that axis' end value."""
    axis, rest = axes[0], axes[1:]
    if len(axis) == 1:
        return interpolate(rest, grid[0], point[1:]) if rest else grid[0]
    logs = [math.log(a) for a in axis]
    x = min(max(math.log(point[0]), logs[0]), logs[-1])
    i = min(max(bisect.bisect_right(logs, x) - 1, 0), len(axis) - 2)
    t = (x - logs[i]) / (logs[i + 1] - logs[i])
    lo, hi = grid[i], grid[i + 1]
    if rest:
        lo, hi = interpolate(rest, lo, point[1:]), interpolate(rest, hi, point[1:])
    return (1 - t) * lo + t * hi


@dataclass(frozen=True, eq=False)
class DeviceProfile:
    name: str
    source: str  # the file it was read from
    matmul_axes: list[list[float]]  # tokens, width, n / width
    matmul_tflops: list  # [tokens][width][ratio]
    attention: dict[str, tuple[list[list[float]], list]] = field(default_factory=dict)
    scale: float = 1.0  # the nominal-peak ratio where another device's profile stands in
    note: str = ""  # one line for the estimate's output

    def matmul_flops_per_s(self, tokens: float, width: float, n: float) -> float:
        """A (tokens x width)(width x n) linear's forward and both gradients, FLOP/s."""
        tflops = interpolate(self.matmul_axes, self.matmul_tflops, [tokens, width, n / width])
        return tflops * 1e12 * self.scale

    def attention_flops_per_s(self, backend: str, head_dim: int, seq: int) -> float:
        """Causal attention forward+backward, FLOP/s by the estimator's count (every score);
        the backend's own kernel where measured, else the first measured one."""
        kernel = ATTENTION_KERNEL.get(backend, "flash")
        axes, grid = self.attention.get(kernel) or next(iter(self.attention.values()))
        return interpolate(axes, grid, [head_dim, seq]) * 1e12 * self.scale


def _grid_ok(grid, axes: list[list[float]]) -> bool:
    if not axes:
        return isinstance(grid, int | float) and grid > 0
    return (
        isinstance(grid, list)
        and len(grid) == len(axes[0])
        and all(_grid_ok(g, axes[1:]) for g in grid)
    )


def load_profile(path: Path, name: str | None = None) -> DeviceProfile:
    """A profile file, checked: every matmul point measured and positive, one attention
    kernel at least; refused in one line naming what is wrong and the fix."""
    fix = "write it again with the GPU pass's calibrate section (docs/parallel.md)"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"device profile {path}: cannot read it ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"device profile {path}: not a format-{FORMAT} profile; {fix}")
    mm = data.get("matmul") or {}
    axes = [mm.get("tokens"), mm.get("width"), mm.get("shard_ratio")]
    if not all(isinstance(a, list) and a for a in axes) or not _grid_ok(mm.get("tflops"), axes):
        raise ConfigError(
            f"device profile {path}: its matmul grid has points missing or not positive; {fix}"
        )
    attention = {}
    for kernel, entry in ((data.get("attention") or {}).get("backends") or {}).items():
        att_axes = [entry.get("head_dim"), entry.get("seq")]
        if all(isinstance(a, list) and a for a in att_axes) and _grid_ok(entry["tflops"], att_axes):
            attention[kernel] = (att_axes, entry["tflops"])
    if not attention:
        raise ConfigError(f"device profile {path}: no attention kernel measured whole; {fix}")
    prov = data.get("provenance") or {}
    name = name or data.get("device") or path.stem
    note = (
        f"estimate.device={name}: compute from {path} ({data.get('device_name')}, "
        f"{prov.get('date')}, torch {prov.get('torch')})"
    )
    return DeviceProfile(name, str(path), axes, mm["tflops"], attention, note=note)


def available(folder: Path | None = None) -> list[str]:
    """The profiles conf/device/ holds, by name."""
    folder = folder or PROFILES
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve(device: str, folder: Path | None = None) -> DeviceProfile | None:
    """The profile ``estimate.device`` names; None for cuda and cpu (the nominal model)."""
    folder = folder or PROFILES
    if device in NOMINAL_KERNELS:
        return None
    if device.endswith((".yaml", ".yml")):
        if not Path(device).is_file():
            raise ConfigError(f"estimate.device={device}: no such file; name a profile .yaml")
        return load_profile(Path(device))
    names = available(folder)
    if device in names:
        return load_profile(folder / f"{device}.yaml", device)
    bases = [n for n in names if n in NOMINAL_BF16_TFLOPS]
    if device in NOMINAL_BF16_TFLOPS and bases:
        base = load_profile(folder / f"{bases[0]}.yaml", bases[0])
        ratio = NOMINAL_BF16_TFLOPS[device] / NOMINAL_BF16_TFLOPS[bases[0]]
        note = (
            f"estimate.device={device}: no profile of its own; {bases[0]}'s measured rates "
            f"({base.source}) scaled by its nominal bf16 peak over {bases[0]}'s, "
            f"{NOMINAL_BF16_TFLOPS[device]:g}/{NOMINAL_BF16_TFLOPS[bases[0]]:g} TFLOP/s"
        )
        return DeviceProfile(
            device, base.source, base.matmul_axes, base.matmul_tflops, base.attention,
            scale=ratio, note=note,
        )  # fmt: skip
    if device in NOMINAL_BF16_TFLOPS:
        raise ConfigError(
            f"estimate.device={device}: no device profile in {folder} to scale from; run the "
            "GPU pass's calibrate section and commit its profile, or leave estimate.device "
            "unset (estimate.flops_per_s)"
        )
    raise ConfigError(
        f"estimate.device={device} is unknown; choose cuda, cpu, a profile of {folder} "
        f"({', '.join(names) or 'none yet'}), a GPU scaled from one "
        f"({', '.join(NOMINAL_BF16_TFLOPS)}), or a path to a profile .yaml"
    )
