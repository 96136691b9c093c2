"""Faults of a run as a whole: a full disk under metrics.jsonl, two runs in one directory,
Ctrl-C and failing ranks. Each docstring quotes the line the user sees. The launcher runs
2 stand-in ranks (rank_stubs.py) in the fast tests; real 2-rank runs are marked slow."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import compose_config, one_line, small_run_overrides
from test_cli import train_cli

from llm.errors import ConfigError, Interrupted, LabError, TrainingError
from llm.launch.launcher import launch


def test_disk_full_in_the_metrics_writer(tmp_path):
    """error: no space left on DIR (N MB free) for metrics.jsonl; free space there or point
    hydra.run.dir at a disk with room, then run the same command to resume"""
    from llm.config import LoggerConfig
    from llm.logging import RunLogger

    logger = RunLogger(LoggerConfig(name="none", progress=False), tmp_path, {}, 10, "r", None)

    class FullFile:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = write

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    logger.metrics_file = FullFile()
    with pytest.raises(
        LabError, match=rf"no space left on {tmp_path} \(\d+ MB free\) for metrics\.jsonl"
    ) as err:
        logger.log(1, {"loss": 1.0})
    assert err.value.__cause__ is None and err.value.__context__ is not None
    one_line(err)
    logger.close()  # the refused buffer is not reported a second time


# --- two runs, one directory -------------------------------------------------------------


def test_a_second_run_in_a_live_run_directory_is_refused(tmp_path, text_corpus, cache_dir):
    """error: run directory DIR is in use by another run (PID 1234 on host HOST); wait for it
    to finish or stop it, or give this run its own hydra.run.dir"""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from llm.runfiles.run_dir_lock import RunDirLock; RunDirLock(sys.argv[1]).acquire();"
            " print('locked', flush=True); sys.stdin.read()",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = compose_config(small_run_overrides(out, text_corpus, cache_dir))
        with pytest.raises(
            ConfigError, match=rf"PID {holder.pid} on host {socket.gethostname()}"
        ) as err:
            launch(cfg)
        assert "its own hydra.run.dir" in one_line(err)
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()  # the kernel frees the lock of a killed holder
        holder.wait()
    from llm.runfiles.run_dir_lock import RunDirLock

    with RunDirLock(out):
        pass


# --- several ranks -----------------------------------------------------------------------
# The launcher's own behaviour runs fast on stand-in ranks (tests/rank_stubs.py); the same
# through train.py with real training ranks is in make test-slow.


def stub_config(tmp_path):
    return compose_config(
        [f"output_dir={tmp_path}", "parallelism=ddp", "launcher.nproc_per_node=2"]
    )


@pytest.mark.slow
def test_ctrl_c_waits_for_the_ranks_checkpoint(tmp_path):
    """stopped: interrupted (Ctrl-C); the newest checkpoint is DIR/checkpoints/step_000003:
    run the same command to resume from it   (train.py exits 130)"""
    import threading

    import rank_stubs

    from llm.launch.launcher import _spawn

    done = threading.Event()

    def press_ctrl_c():
        ready = [tmp_path / f"ready{r}" for r in (0, 1)]
        while not all(p.exists() for p in ready):
            if done.wait(0.05):
                return  # the launcher ended without its ranks: nothing to interrupt
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c)
    presser.start()
    try:
        with pytest.raises(
            LabError, match=r"interrupted \(Ctrl-C\); the newest checkpoint is"
        ) as err:
            _spawn(stub_config(tmp_path), 2, rank_stubs.checkpoints_on_sigterm)
    finally:
        done.set()
        presser.join()
    assert err.value.exit_code == 130
    assert str(tmp_path / "checkpoints/step_000003") in one_line(err)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_the_ranks_at_once(tmp_path):
    """Ctrl-C: stopping after this step; Ctrl-C again to stop now
    stopped: interrupted (Ctrl-C) before any checkpoint was written; nothing to resume"""
    import threading

    import rank_stubs

    from llm.launch.launcher import _spawn

    done = threading.Event()

    def press_ctrl_c_twice():
        ready = [tmp_path / f"ready{r}" for r in (0, 1)]
        while not all(p.exists() for p in ready):
            if done.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the ranks ignore the SIGTERM they were passed
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c_twice)
    began = time.monotonic()
    presser.start()
    try:
        with pytest.raises(Interrupted) as err:
            _spawn(stub_config(tmp_path), 2, rank_stubs.slow_to_stop)
    finally:
        done.set()
        presser.join()
    assert err.value.exit_code == 130 and one_line(err).startswith("interrupted (Ctrl-C)")
    assert time.monotonic() - began < 60  # the stubs alone would wait 120 s


def test_sigterm_while_ranks_start_reaches_them(tmp_path, monkeypatch):
    """A SIGTERM that lands while the ranks are being spawned (Slurm preempting a job that
    has just begun) is passed on once they exist, instead of being lost while the ranks
    train on; the run ends as any SIGTERM does (stopped: terminated (SIGTERM) ...; exit 143),
    not as a failure."""
    import rank_stubs
    import torch.multiprocessing as mp

    from llm.launch.launcher import _spawn

    start = mp.start_processes

    def start_after_a_sigterm(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # our handler is installed: it only records
        return start(*args, **kwargs)

    monkeypatch.setattr(mp, "start_processes", start_after_a_sigterm)
    began = time.monotonic()
    with pytest.raises(Interrupted) as err:
        _spawn(stub_config(tmp_path), 2, rank_stubs.checkpoints_on_sigterm)
    assert one_line(err).startswith("terminated (SIGTERM)") and err.value.exit_code == 143
    assert "while stopping" not in one_line(err)  # a rank ended by our SIGTERM did not fail
    assert time.monotonic() - began < 60  # the stub alone would wait 120 s for a signal


def test_an_exception_while_waiting_ends_the_ranks(tmp_path):
    """A caller's timeout (pytest-timeout's alarm, say) raised while the launcher waits must
    not leave the ranks running on their own: they are killed before it propagates."""
    import rank_stubs
    import torch.multiprocessing as mp

    from llm.launch.launcher import _spawn

    class CallerTimeout(Exception):
        pass

    def alarm(signum, frame):
        raise CallerTimeout

    started = []
    start = mp.start_processes

    def record(*args, **kwargs):
        context = start(*args, **kwargs)
        started.append(context)
        return context

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mp, "start_processes", record)
            signal.alarm(5)  # the stubs wait 120 s for a SIGTERM
            with pytest.raises(CallerTimeout):
                _spawn(stub_config(tmp_path), 2, rank_stubs.slow_to_stop)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    processes = started[0].processes
    for process in processes:
        process.join(timeout=30)
    assert [p.is_alive() for p in processes] == [False, False]
    assert all(p.exitcode == -signal.SIGKILL for p in processes)


def test_ctrl_c_on_one_rank_ends_the_same_way(tmp_path, text_corpus, cache_dir, monkeypatch):
    """stopped: interrupted (Ctrl-C) before any checkpoint was written; nothing to resume"""
    from llm import run
    from llm.train.stop import StopRequested

    with StopRequested() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested and stop.signal == "SIGINT"  # the Trainer's summary carries it
    monkeypatch.setattr(run, "main", lambda cfg, env: {"stop_signal": "SIGINT"})
    cfg = compose_config(small_run_overrides(tmp_path / "run", text_corpus, cache_dir))
    with pytest.raises(LabError, match=r"interrupted \(Ctrl-C\) before any checkpoint") as err:
        launch(cfg)
    assert err.value.exit_code == 130


@pytest.mark.slow
def test_a_failing_rank_shows_its_own_error(tmp_path):
    """error: rank 1 failed: RuntimeError: injected fault on rank 1 (traceback:
    DIR/.rank_errors/rank1.txt)"""
    import rank_stubs

    from llm.launch.launcher import _spawn

    with pytest.raises(TrainingError, match="rank 1 failed: RuntimeError: injected fault") as err:
        _spawn(stub_config(tmp_path), 2, rank_stubs.fails_on_rank1)
    trace = Path(one_line(err).rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert trace == tmp_path / ".rank_errors/rank1.txt"
    assert "Traceback (most recent call last)" in trace.read_text()


@pytest.mark.slow
def test_ctrl_c_on_two_ranks_through_train_py(tmp_path, text_corpus, cache_dir):
    """stopped: interrupted (Ctrl-C); the newest checkpoint is DIR/checkpoints/step_N: run
    the same command to resume from it"""
    out = tmp_path / "run"
    args = small_run_overrides(
        out,
        text_corpus,
        cache_dir,
        "parallelism=ddp",
        "launcher.nproc_per_node=2",
        "train.max_steps=100000",
    )
    proc = train_cli(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("stopped: interrupted (Ctrl-C); the newest checkpoint is ")
    checkpoint = last.split("the newest checkpoint is ")[1].split(": run")[0]
    assert checkpoint.startswith(str(out / "checkpoints" / "step_"))
    assert len(list(Path(checkpoint).glob("rng_rank*.pt"))) == 2


@pytest.mark.slow
def test_a_dying_rank_of_a_real_run_shows_its_own_error(tmp_path, text_corpus, cache_dir):
    """error: rank 0 failed: RuntimeError: Distributed package doesn't have NCCL built in
    (traceback: DIR/.rank_errors/rank0.txt)"""
    out = tmp_path / "run"
    cfg = compose_config(
        small_run_overrides(
            out,
            text_corpus,
            cache_dir,
            "parallelism=ddp",
            "launcher.nproc_per_node=2",
            "launcher.backend=nccl",  # NCCL with CPU tensors: the ranks themselves fail
        )
    )
    with pytest.raises(LabError, match=r"rank \d failed: \w+Error: .*\(traceback: ") as err:
        launch(cfg)
    message = one_line(err)
    assert "exited with code" not in message
    trace = Path(message.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert trace.parent == out / ".rank_errors"
    assert "Traceback (most recent call last)" in trace.read_text()


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    """error: rank 1 was killed by SIGKILL before it could report an error (SIGKILL is often
    the out-of-memory killer: check dmesg, and lower train.micro_batch_size or
    launcher.nproc_per_node)"""
    from llm.launch.rank_failures import rank_failure, record_rank_failure

    # Rank 0 then failed on losing its peer; the kill is the cause the user must see.
    record_rank_failure(tmp_path, 0, "rank 0 failed: DistBackendError: connection closed", "tb")
    message = rank_failure(tmp_path, 1, -9, "SIGKILL")
    assert message.startswith("rank 1 was killed by SIGKILL") and "dmesg" in message
    assert rank_failure(tmp_path, 0, 1, None).startswith("rank 0 failed: DistBackendError")


def test_torchrun_error_file_carries_the_line(tmp_path):
    """(torchrun's failure report) error_file: {"message": {"message": "ConfigError:
    data.seq_len=100000 exceeds model gpt2-mini's max_seq_len=512; ..."}}"""
    import json

    error_file = tmp_path / "error.json"
    result = train_cli(
        ["data.seq_len=100000", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env_extra={"TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    assert result.returncode == 1
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("ConfigError: data.seq_len=100000 exceeds model")
