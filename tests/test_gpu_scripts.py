"""The GPU session's shell scripts (scripts/gpu_session.sh, scripts/gpu_profiles.sh): they
parse, and the profile loop, with a stand-in python3 on PATH, runs each profile it has time
for with its overrides and packs what each wrote, without the Chrome trace."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("scripts/gpu_session.sh", "scripts/gpu_profiles.sh")

# A python3 that records its arguments and writes what profile_step writes under --out.
STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
out=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
mkdir -p "$out"; echo report > "$out/report.md"; echo trace > "$out/trace.json"
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_parses(script):
    done = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _profiles(tmp_path, end_s: int, started_s: int) -> tuple[list[str], str, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STAND_IN)
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    calls = tmp_path / "calls.txt"
    calls.touch()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SECONDS_AT_START": str(started_s),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_profiles.sh"), str(out), str(end_s)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    with tarfile.open(out / "profiles.tgz") as tar:
        names = sorted(n for n in tar.getnames() if n.endswith((".md", ".json")))
    return calls.read_text().splitlines(), done.stdout, names


def test_every_profile_runs_and_is_packed_without_its_trace(tmp_path):
    calls, said, names = _profiles(tmp_path, end_s=585, started_s=0)
    assert len(calls) == 4 and all("-m benchmarks.profile_step" in c for c in calls)
    assert "model=gpt2-small" in calls[0] and "train.fused_loss=liger" in calls[0]
    assert "model=llama-1b" in calls[3] and "train.fused_loss=off" in calls[3]
    assert said.count("exit 0") == 4
    for shape in ("gpt2", "llama"):
        for when in ("after", "before"):
            assert f"./{shape}-{when}/report.md" in names
            assert f"./{shape}-{when}/stdout.md" in names
    assert not [n for n in names if n.endswith("trace.json")]


def test_no_profile_starts_past_the_end(tmp_path):
    calls, said, _ = _profiles(tmp_path, end_s=585, started_s=580)
    assert calls == [] and said.count("not run, past 585 s") == 4
