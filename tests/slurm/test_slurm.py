"""The cluster path against a real Slurm: a one-host cluster of two nodes (2 CPUs each)
that scripts/slurm_local.sh starts for the session (conftest.py). Tiny CPU runs (gpt2-tiny,
byte tokenizer, gloo), each compared with one local 2-rank run of the same config and seed.

`make test-slurm` (8 tests, cluster start and stop included) took 9 min 8 s on 2 cores
shared with other jobs (load average 7-9): about 1.5 min of CPU, the rest waiting for a
core. Startup (Python, torch, gloo) dominates each run, not its 20 steps; a requeue adds
cred_expire (5 s) and a second startup.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import read_metrics, small_run_overrides, train_losses

REPO = Path(__file__).resolve().parents[2]
STEPS = 20  # long enough to signal a running job at step 2 and see it stop before the end

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def overrides(corpus: Path, cache: Path, *extra: str, steps: int = STEPS) -> list[str]:
    """helpers.small_run_overrides on the command line: Hydra's run or sweep directory is
    the run's (no output_dir); DDP, so that 1 or 2 ranks run the same config."""
    keep = [
        o
        for o in small_run_overrides(Path("unused"), corpus, cache)
        if not o.startswith(("output_dir=", "train.max_steps="))
    ]
    return [*keep, "parallelism=ddp", f"train.max_steps={steps}", *extra]


def train(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *args]


def submitit(sweep: Path, *args: str) -> list[str]:
    """train.py -m through Hydra's submitit launcher onto the test cluster."""
    return train("-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep}", *args)


def job_ids(sweep: Path) -> list[str]:
    """The Slurm ids of the jobs that ran (ARRAYID_TASK in a sweep): the folders of
    submitit's task logs."""
    return sorted({p.parent.name for p in (sweep / ".submitit").glob("*/*_log.err")})


def job_logs(sweep: Path) -> str:
    """Every task's stderr, for an assertion's message."""
    logs = sorted((sweep / ".submitit").glob("*/*_log.err")) if sweep.exists() else []
    return "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


def losses_equal(out: Path, reference: dict[int, float]) -> None:
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))  # each step once, after a resume too
    assert losses == pytest.approx(reference, rel=0, abs=1e-6)


def wait_for_steps(run_dir: Path, steps: int, alive: Callable[[], bool], why: Callable[[], str]):
    """The "started" marker: metrics.jsonl holds ``steps`` logged losses."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and sum('"loss"' in line for line in metrics.open()) >= steps:
            return
        if not alive():
            pytest.fail(f"ended before step {steps}:{why()}")
        time.sleep(0.2)
    pytest.fail(f"no step {steps} in 300 s:{why()}")


@contextmanager
def background(cmd: list[str], env: dict, cwd: Path, log: Path):
    """``cmd`` running, its output in ``log``; killed on the way out if still running."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir, slurm) -> dict[int, float]:
    """The losses of `python train.py launcher.nproc_per_node=2`, outside any allocation."""
    out = tmp_path_factory.mktemp("reference") / "run"
    env = {k: v for k, v in slurm.env.items() if k != "SLURM_CONF"}
    cmd = train(*overrides(text_corpus, cache_dir), "launcher.nproc_per_node=2")
    result = subprocess.run(
        [*cmd, f"hydra.run.dir={out}"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    return train_losses(out)


def test_submitit_job_ranks_come_from_srun(slurm, tmp_path, text_corpus, cache_dir, reference):
    """One task on each node, started by srun: 2 ranks, the local run's losses."""
    sweep = tmp_path / "sweep"
    cmd = submitit(
        sweep,
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1",
        *overrides(text_corpus, cache_dir),
    )
    result = subprocess.run(
        cmd, env=slurm.env, cwd=tmp_path, capture_output=True, text=True, timeout=500
    )
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(sweep)
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    (job_id,) = job_ids(sweep)
    job = slurm.wait_until_done(job_id)  # the client has the results before Slurm ends it
    assert (job["JobState"], job["NumNodes"], job["NumTasks"]) == ("COMPLETED", "2", "2")
    for task in (0, 1):  # each task ran as a rank, not as a run of its own
        assert (sweep / ".submitit" / job_id / f"{job_id}_{task}_result.pkl").is_file()
    losses_equal(sweep / "0", reference)


def test_a_sweep_of_two_jobs_of_two_ranks(slurm, tmp_path, text_corpus, cache_dir):
    """`-m ... optimizer.lr=a,b`: a Slurm array of two jobs, each 2 srun ranks on a node."""
    sweep = tmp_path / "sweep"
    cmd = submitit(
        sweep,
        "hydra.launcher.tasks_per_node=2",
        *overrides(text_corpus, cache_dir, steps=6),
        "optimizer.lr=1e-3,3e-4",
    )
    result = subprocess.run(
        cmd, env=slurm.env, cwd=tmp_path, capture_output=True, text=True, timeout=500
    )
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(sweep)
    ids = job_ids(sweep)
    assert len(ids) == 2 and {i.split("_")[0] for i in ids} == {ids[0].split("_")[0]}
    for job in ids:
        assert slurm.wait_until_done(job)["JobState"] == "COMPLETED"
        assert sorted(p.name for p in (sweep / ".submitit" / job).glob("*_result.pkl")) == [
            f"{job}_0_result.pkl",
            f"{job}_1_result.pkl",
        ]
    for i, lr in enumerate((1e-3, 3e-4)):
        summary = json.loads((sweep / str(i) / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 6
        assert read_metrics(sweep / str(i))[0]["lr"] == pytest.approx(lr)


@pytest.mark.parametrize(
    "sig, ranks",
    [("TERM", "srun"), ("USR1", "srun"), ("USR1", "spawned")],
    ids=["TERM-srun-ranks", "USR1-srun-ranks", "USR1-spawned-ranks"],
)
def test_a_preempted_job_checkpoints_requeues_and_resumes(
    sig, ranks, slurm, tmp_path, text_corpus, cache_dir, reference
):
    """`scancel --signal=TERM` (Slurm's preemption) or submitit's own signal (here USR1,
    SUBMITIT_PREEMPT_SIGNAL; sbatch --signal=USR1@...): every rank checkpoints at the same
    step, submitit requeues the job, and the requeued job resumes from that checkpoint and
    ends with the uninterrupted run's losses. "spawned": one task that spawns its 2 ranks."""
    sweep = tmp_path / "sweep"
    env = {**slurm.env, **({} if sig == "TERM" else {"SUBMITIT_PREEMPT_SIGNAL": sig})}
    layout = (
        ["hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]
        if ranks == "srun"
        else ["hydra.launcher.tasks_per_node=1", "launcher.nproc_per_node=2"]
    )
    cmd = submitit(sweep, *layout, *overrides(text_corpus, cache_dir))
    log = tmp_path / "client.log"
    with background(cmd, env, tmp_path, log) as client:
        wait_for_steps(
            sweep / "0",
            2,
            alive=lambda: client.poll() is None,
            why=lambda: log.read_text()[-3000:] + job_logs(sweep),
        )
        (job_id,) = job_ids(sweep)
        slurm.run("scancel", f"--signal={sig}", job_id)
        returncode = client.wait(timeout=400)
    assert returncode == 0, log.read_text()[-3000:] + job_logs(sweep)
    job = slurm.wait_until_done(job_id)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), job_logs(sweep)
    task0 = (sweep / ".submitit" / job_id / f"{job_id}_0_log.err").read_text()
    assert f"stopped: terminated (SIG{sig})" in task0
    assert "requeueing the job through submitit" in task0
    resumed = re.search(r"resumed from \S+/step_(\d+) at step", task0)
    assert resumed and 2 <= int(resumed.group(1)) < STEPS, task0[-3000:]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["steps"] == STEPS and not summary["stopped_early"]
    losses_equal(sweep / "0", reference)
    if sig != "TERM":  # the submitting process asked Slurm for that signal before the limit
        submission = (sweep / ".submitit" / job_id / f"{job_id}_submission.sh").read_text()
        assert f"--signal={sig}@" in submission


def test_a_cancelled_job_stays_cancelled(slurm, tmp_path, text_corpus, cache_dir):
    """`scancel JOBID` (no --signal) also sends SIGTERM, but the job is ending (COMPLETING):
    it is not requeued (scontrol requeue would bring back even a cancelled job). (The
    submitting process then fails, once submitit's polling, slower as a job ages, sees it.)"""
    sweep = tmp_path / "sweep"
    cmd = submitit(sweep, "hydra.launcher.tasks_per_node=2", *overrides(text_corpus, cache_dir))
    log = tmp_path / "client.log"
    with background(cmd, slurm.env, tmp_path, log) as client:
        wait_for_steps(
            sweep / "0",
            2,
            alive=lambda: client.poll() is None,
            why=lambda: log.read_text()[-3000:] + job_logs(sweep),
        )
        (job_id,) = job_ids(sweep)
        slurm.run("scancel", job_id)
        job = slurm.wait_until_done(job_id)  # its processes are gone: no requeue to come
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), job_logs(sweep)
    task0 = (sweep / ".submitit" / job_id / f"{job_id}_0_log.err").read_text()
    assert "requeueing" not in task0


def test_a_plain_run_inside_salloc_spawns_its_own_ranks(
    slurm, tmp_path, text_corpus, cache_dir, reference
):
    """In salloc's shell (SLURM_NTASKS=2, no job step) `python train.py` is one process: it
    spawns launcher.nproc_per_node ranks, and with the default 1 it is a world of one (not
    rank 0 of 2, waiting for a peer)."""
    two, one = tmp_path / "two", tmp_path / "one"
    script = " && ".join(
        [
            f"env > {tmp_path}/env.txt",
            shlex.join(
                train(
                    *overrides(text_corpus, cache_dir),
                    "launcher.nproc_per_node=2",
                    f"hydra.run.dir={two}",
                )
            ),
            shlex.join(train(*overrides(text_corpus, cache_dir, steps=2), f"hydra.run.dir={one}")),
        ]
    )
    result = slurm.run(
        "salloc", "-N1", "-n2", "bash", "-c", script, cwd=tmp_path, check=False, timeout=500
    )
    assert result.returncode == 0, result.stderr[-3000:]
    env = dict(
        line.split("=", 1)
        for line in (tmp_path / "env.txt").read_text().splitlines()
        if "=" in line
    )
    assert env["SLURM_NTASKS"] == "2" and "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    losses_equal(two, reference)
    summary = json.loads((one / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 2


def test_the_example_sbatch_script_trains_and_requeues_itself(
    slurm, tmp_path, text_corpus, cache_dir, reference
):
    """examples/slurm.sbatch with tiny overrides (2 nodes, 1 CPU task each): srun's tasks are
    the ranks; `scancel --signal=TERM` stops them after a checkpoint (exit 143), the script
    requeues the job, and the requeued job (same id, same RUN_DIR) resumes and ends with
    the local run's losses."""
    run_dir = tmp_path / "run"
    env = {**slurm.env, "PYTHON": sys.executable, "RUN_DIR": str(run_dir)}
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=15",
        f"--output={tmp_path}/slurm-%j.out",
        str(REPO / "examples" / "slurm.sbatch"),
        *overrides(text_corpus, cache_dir),
        cwd=REPO,  # as a user submits it: train.py is found from there
        env=env,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    out = tmp_path / f"slurm-{job_id}.out"
    output = lambda: "\n" + out.read_text()[-3000:] if out.exists() else ""  # noqa: E731
    try:
        wait_for_steps(
            run_dir,
            2,
            alive=lambda: slurm.job(job_id)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"),
            why=output,
        )
        slurm.run("scancel", "--signal=TERM", job_id)
        job = slurm.wait_until_done(job_id)
    finally:
        slurm.run("scancel", job_id, check=False)  # a no-op once it ended
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), output()
    log = out.read_text()
    assert f"requeueing job {job_id}" in log
    resumed = re.search(r"resumed from \S+/step_(\d+) at step", log)
    assert resumed and 2 <= int(resumed.group(1)) < STEPS, output()
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    losses_equal(run_dir, reference)
