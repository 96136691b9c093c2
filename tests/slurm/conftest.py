"""A real Slurm cluster on this machine for the tests marked ``slurm`` (`make test-slurm`).

scripts/slurm_local.sh starts slurmctld and two slurmd (two nodes of 2 CPUs on this host)
once per session and stops them after the last test, removing every file it wrote. The
tests run only when ``-m`` names the marker: `make test` and `make test-slow` (and a plain
``pytest``) deselect them, so they never start daemons there. Selected, a missing Slurm is
a failure, not a skip (the Makefile target installs it with apt first).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_local.sh"


def pytest_collection_modifyitems(config, items):
    """Deselect the Slurm tests unless the -m expression names them (`-m slurm`)."""
    if "slurm" in (config.getoption("markexpr") or ""):
        return
    slurm = [item for item in items if item.get_closest_marker("slurm")]
    if slurm:
        config.hook.pytest_deselected(items=slurm)
        items[:] = [item for item in items if not item.get_closest_marker("slurm")]


@dataclass
class Cluster:
    directory: Path
    env: dict[str, str]  # this environment with SLURM_CONF and the sacct stand-in on PATH

    def run(self, *cmd: str, **kwargs) -> subprocess.CompletedProcess:
        kwargs = {"env": self.env, "timeout": 60, "check": True, **kwargs}
        return subprocess.run(list(cmd), capture_output=True, text=True, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (jobs stay there 10 minutes after they end)."""
        line = self.run("scontrol", "-o", "show", "job", job_id).stdout.splitlines()[0]
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def wait_until_done(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        """Waits for a job submitted with sbatch (a requeued one through its restarts)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout} s")


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    started = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(
            f"no local Slurm cluster: {started.stderr.strip() or started.stdout.strip()}",
            pytrace=False,
        )
    directory = Path(started.stdout.split()[-1])
    try:
        # Jobs inherit the environment: none of an enclosing allocation's SLURM_* variables.
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        sourced = subprocess.run(
            ["bash", "-c", f'source "{directory}/env" && env -0'],
            env=base,
            capture_output=True,
            text=True,
            check=True,
        )
        pairs = (entry.split("=", 1) for entry in sourced.stdout.split("\0") if "=" in entry)
        env = {**dict(pairs), "PYTHONUNBUFFERED": "1"}
        yield Cluster(directory, env)
    finally:
        stopped = subprocess.run(
            ["bash", str(SCRIPT), "stop", str(directory)], capture_output=True, text=True
        )
        assert stopped.returncode == 0, stopped.stderr
