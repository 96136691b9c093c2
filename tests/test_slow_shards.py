"""The slow suite's shards (scripts/slow_shards.py, `make test-slow SHARD=NAME`) hold every
file with a slow test exactly once, so running the three shards runs the whole slow suite;
an unknown shard is refused in one line instead of running everything."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from slow_shards import SHARDS, main  # noqa: E402


def _slow_files() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "slow and not gpu", "--collect-only", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_every_file_with_a_slow_test_is_in_exactly_one_shard():
    listed = Counter(f for files in SHARDS.values() for f in files)
    assert [f for f, n in listed.items() if n > 1] == []
    assert set(listed) == _slow_files()


def test_an_unknown_shard_is_refused_and_no_shard_means_the_whole_suite(capsys):
    assert main(["nope"]) == 2
    assert "SHARD=nope is not a shard" in capsys.readouterr().err
    assert main([]) == 0 and capsys.readouterr().out == ""
    assert main(["parallel"]) == 0
    assert capsys.readouterr().out.split() == SHARDS["parallel"]
