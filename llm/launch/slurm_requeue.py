"""Preemption of a job that Hydra's submitit launcher runs on Slurm
(``hydra/launcher=submitit_slurm``): checkpoint on every rank, then requeue through submitit.

submitit runs each task of the job in ``python -m submitit.core._submit``, which installs
its own handlers before our code runs: SIGTERM is only logged, and its preemption signal
(SIGUSR2, or ``SUBMITIT_PREEMPT_SIGNAL``; sbatch's ``--signal=USR2@signal_delay_s``, sent
before the time limit and by ``scancel --signal``) makes rank 0 resubmit the job and
``sys.exit`` at once: mid-step, without a checkpoint, while the other ranks wait for it.

Here, while ``llm.launch.launcher.launch`` runs, that signal stops the run as SIGTERM does
(every rank checkpoints at the same step; the process's SIGTERM handler is called with it), and a
run a signal stopped (``Interrupted``, Ctrl-C aside) is then, if the job is still RUNNING
(a plain ``scancel`` leaves it COMPLETING and is not undone), handed to submitit's own
handler on rank 0: it calls the launcher's ``checkpoint()`` (the same Hydra job again),
counts time-outs against ``hydra.launcher.max_num_timeout`` and runs ``scontrol requeue``.
The requeued job runs in the same run directory and resumes from the newest checkpoint
(``checkpoint.resume=auto``). No rank leaves a result, so Hydra's submitting process keeps
waiting for the requeued job. Outside a submitit Slurm job nothing changes.

Spawned local ranks (one task, ``launcher.nproc_per_node>1``) ignore the preemption signal
(``ignore_in_rank``): Slurm signals every process of the step, and the launcher passes the
stop on to its ranks as SIGTERM.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import subprocess
from collections.abc import Callable, Mapping

from llm.errors import Interrupted
from llm.logging import say
from llm.train.stop import exit_code


def preemption_signal(env: Mapping[str, str]) -> signal.Signals | None:
    """submitit's preemption signal inside a submitit Slurm job, else None."""
    if env.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    return getattr(signal, "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


def ignore_in_rank(env: Mapping[str, str]) -> None:
    """In a spawned local rank: the preemption signal's default action would kill it."""
    if (sig := preemption_signal(env)) is not None:
        signal.signal(sig, signal.SIG_IGN)


def _as_sigterm(signum, frame) -> None:
    # The process's SIGTERM handler (the stop guard, or the launcher's, which passes the
    # stop on to its ranks) records this signal under its own name.
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signum, frame)


def requeue_on_preemption(env: Mapping[str, str]) -> Callable:
    """Decorates ``launch``: under submitit on Slurm, a run a signal stopped is requeued
    (above). ``env`` is read at each call (``os.environ``, passed by llm.launch.launcher)."""

    def decorate(launch: Callable) -> Callable:
        @functools.wraps(launch)
        def wrapper(*args, **kwargs):
            sig = preemption_signal(env)
            submitit_handler = signal.getsignal(sig) if sig is not None else None
            # submitit's SignalHandler.checkpoint_and_try_requeue, bound to the job's state.
            if getattr(submitit_handler, "__name__", "") != "checkpoint_and_try_requeue":
                return launch(*args, **kwargs)
            signal.signal(sig, _as_sigterm)
            try:
                return launch(*args, **kwargs)
            except Interrupted as exc:
                if exc.exit_code == exit_code("SIGINT"):
                    raise
                _requeue(exc, env, sig, submitit_handler)
            finally:
                signal.signal(sig, submitit_handler)

        return wrapper

    return decorate


def job_state(job_id: str) -> str | None:
    """The job's state as slurmctld has it now (RUNNING, COMPLETING, ...), None if unknown."""
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bJobState=(\S+)", out)
    return found.group(1) if found else None


def _requeue(stopped: Interrupted, env, sig, submitit_handler) -> None:
    """Never returns: rank 0 requeues the job through submitit, which exits; the other ranks
    exit too. Nobody leaves a result: the submitting process waits for the requeued job.
    Only a job that is still RUNNING is requeued: a signal that ends nothing by itself
    (``scancel --signal``, sbatch's ``--signal`` before the time limit). A job that Slurm is
    ending (``scancel`` without ``--signal``, the time limit) shows COMPLETING, and
    ``scontrol requeue`` would bring back even a cancelled job."""
    if env.get("SLURM_PROCID", "0") != "0":
        raise SystemExit(0)
    state = job_state(env.get("SLURM_JOB_ID", ""))
    if state != "RUNNING":
        say(f"not requeued: the job is {state or 'unknown to scontrol'}", logging.WARNING)
        raise stopped
    say(f"stopped: {stopped}", logging.WARNING)
    say("requeueing the job through submitit: it resumes from there")
    received = signal.Signals(stopped.exit_code - 128) if stopped.exit_code > 128 else sig
    try:
        submitit_handler(received, None)  # checkpoint(), scontrol requeue, sys.exit
    except subprocess.CalledProcessError as exc:
        say(f"error: the job was not requeued: {exc}", logging.ERROR)
    raise stopped
