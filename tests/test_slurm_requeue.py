"""llm.launch.slurm_requeue without Slurm: a stand-in for submitit's signal handler (the real
cluster path is tests/slurm/, `make test-slurm`)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from llm.errors import Interrupted
from llm.launch import slurm_requeue
from llm.launch.slurm_requeue import ignore_in_rank, requeue_on_preemption
from llm.train.stop import exit_code

SUBMITIT = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1", "SLURM_PROCID": "0"}


class SignalHandler:
    """submitit.core.job_environment.SignalHandler's requeue entry, recorded."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[int] = []
        self.fails = fails

    def checkpoint_and_try_requeue(self, signum, frame) -> None:
        self.calls.append(signum)
        if self.fails:
            raise subprocess.CalledProcessError(1, ["scontrol", "requeue", "7"])
        raise SystemExit(-1)  # submitit exits once the job is requeued


@pytest.fixture
def submitit_handler(monkeypatch):
    monkeypatch.setattr(slurm_requeue, "job_state", lambda job_id: "RUNNING")
    handler = SignalHandler()
    previous = signal.signal(signal.SIGUSR1, handler.checkpoint_and_try_requeue)
    yield handler
    signal.signal(signal.SIGUSR1, previous)


def stopped_by(name: str):
    """A launch whose run a signal stopped: its SIGTERM handler records what it heard."""
    heard = []

    def launch():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
        try:
            os.kill(os.getpid(), getattr(signal, name))
        finally:
            signal.signal(signal.SIGTERM, previous)
        raise Interrupted(f"terminated ({name})", exit_code(name))

    return launch, heard


def test_outside_submitit_nothing_changes(submitit_handler):
    launch = requeue_on_preemption({})(lambda: "summary")
    assert launch() == "summary"
    assert signal.getsignal(signal.SIGUSR1) == submitit_handler.checkpoint_and_try_requeue


def test_the_preemption_signal_stops_the_run_then_rank_0_requeues(submitit_handler):
    launch, heard = stopped_by("SIGUSR1")
    with pytest.raises(SystemExit) as exc:
        requeue_on_preemption(SUBMITIT)(launch)()
    assert exc.value.code == -1
    # The run heard it through its SIGTERM handler (every rank checkpoints), not submitit.
    assert heard == [signal.SIGUSR1]
    assert submitit_handler.calls == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) == submitit_handler.checkpoint_and_try_requeue


def test_sigterm_requeues_too_and_other_ranks_exit_without_a_result(submitit_handler):
    launch, _ = stopped_by("SIGTERM")
    with pytest.raises(SystemExit) as exc:
        requeue_on_preemption({**SUBMITIT, "SLURM_PROCID": "1"})(launch)()
    assert exc.value.code == 0 and submitit_handler.calls == []
    with pytest.raises(SystemExit):
        requeue_on_preemption(SUBMITIT)(launch)()
    assert submitit_handler.calls == [signal.SIGTERM]


def test_ctrl_c_and_a_refused_requeue_stay_stops(submitit_handler):
    def interrupted():
        raise Interrupted("interrupted (Ctrl-C)", exit_code("SIGINT"))

    with pytest.raises(Interrupted):
        requeue_on_preemption(SUBMITIT)(interrupted)()
    assert submitit_handler.calls == []
    submitit_handler.fails = True  # scontrol requeue refused: a cancelled job
    launch, _ = stopped_by("SIGTERM")
    with pytest.raises(Interrupted, match="SIGTERM"):
        requeue_on_preemption(SUBMITIT)(launch)()


def test_a_job_slurm_is_ending_is_not_requeued(submitit_handler, monkeypatch):
    """scancel without --signal: the job is COMPLETING, and a requeue would bring it back."""
    monkeypatch.setattr(slurm_requeue, "job_state", lambda job_id: "COMPLETING")
    launch, _ = stopped_by("SIGTERM")
    with pytest.raises(Interrupted, match="SIGTERM"):
        requeue_on_preemption(SUBMITIT)(launch)()
    assert submitit_handler.calls == []


def test_spawned_ranks_ignore_the_preemption_signal():
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        ignore_in_rank(SUBMITIT)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
