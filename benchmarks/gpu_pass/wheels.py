"""``python -m benchmarks.gpu_pass.wheels`` (``make gpu-wheels``): the wheels of
requirements-gpu.txt in .whl/, for a GPU machine with no package index (CPython 3.12,
manylinux x86_64), at most 40 MiB in all.

A package published only as a source archive is built into a wheel here, and must come out
pure Python (``py3-none-any``), since it is built on this machine and installed on that one.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_MIB = 40
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip


def pinned(path: Path) -> list[str]:
    """``name==version`` lines of the list (comments dropped); anything unpinned is refused."""
    specs = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.\-]+", line):
            raise SystemExit(f"{path.name}: {line!r} is not pinned as name==version")
        specs.append(line)
    return specs


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def fetch(spec: str, dest: Path) -> None:
    """A binary wheel for the GPU machine, or a pure-Python wheel built from the source."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    done = _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                "--implementation", "cp", *platforms, "-d", str(dest), spec)  # fmt: skip
    if done.returncode == 0:
        return
    before = set(dest.iterdir())
    built = _pip("wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", str(dest), spec)
    new = set(dest.iterdir()) - before
    if built.returncode != 0 or not new:
        raise SystemExit(
            f"{spec}: no wheel for CPython 3.12 manylinux and no build: {built.stderr}"
        )
    impure = [p.name for p in new if not p.name.endswith("-py3-none-any.whl")]
    if impure:
        raise SystemExit(f"{spec}: built {impure}, not pure Python; it cannot travel")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", default=str(REPO / "requirements-gpu.txt"))
    p.add_argument("--dest", default=str(REPO / ".whl"))
    a = p.parse_args(argv)
    dest = Path(a.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for spec in pinned(Path(a.list)):
        fetch(spec, dest)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB in {len(wheels)} wheels under {dest}")
    if total > LIMIT_MIB * 2**20:
        raise SystemExit(f"the wheels take {total / 2**20:.1f} MiB, over the {LIMIT_MIB} MiB limit")


if __name__ == "__main__":
    main()
