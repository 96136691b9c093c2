"""The faults and bad inputs the repo survives: each ends in one line that names the problem
and the fix, and loses nothing. Each test's docstring quotes the line the user sees.

Disk-full cases patch the writer (tmpfs is not available to tests); multi-rank cases run 2
gloo ranks on tiny shapes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import CONF, compose_config, read_metrics, small_run_overrides
from hydra.errors import MissingConfigException
from test_cli import train_cli

from llm.config import DataConfig
from llm.data import prepare_data
from llm.errors import CheckpointError, ConfigError, DataError, LabError, TrainingError
from llm.launch import launch
from llm.parallel.step import overflow_checked_step
from llm.precision import disabled_loss_scaler
from llm.validate import validate

BASE = ["output_dir=/tmp/unused"]


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# --- 1. config ------------------------------------------------------------------------------


def test_a_key_added_with_plus_must_exist():
    """error: train.max_stepz is not a config key; did you mean train.max_steps? remove it
    or fix its name (keys of train: max_steps, ...)"""
    with pytest.raises(ConfigError, match=r"did you mean train\.max_steps") as err:
        compose_config([*BASE, "+train.max_stepz=5"])
    assert one_line(err).startswith("train.max_stepz is not a config key")
    with pytest.raises(ConfigError, match="nonsense is not a config key"):
        compose_config([*BASE, "+nonsense=1"])


def test_schemas_are_not_group_options():
    """Hydra: Could not find 'model/model_schema' (the list of models no longer offers it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with pytest.raises(MissingConfigException, match="model_schema"):
        compose_config([*BASE, "model=model_schema"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in ("model", "parallelism", "precision", "data", "launcher"):
            options = loader.get_group_options(group)
            assert options and not [o for o in options if o.endswith("_schema")], group


def test_cpu_ranks_far_beyond_the_cores_are_refused(monkeypatch, caplog):
    """error: launcher.nproc_per_node=64 CPU ranks on 2 usable core(s) would crawl ...; use
    at most 2 ranks, or insist with launcher.allow_oversubscribe=true"""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    ddp = [*BASE, "parallelism=ddp", "train.device=cpu"]
    with pytest.raises(ConfigError, match="64 CPU ranks on 2 usable core") as err:
        validate(compose_config([*ddp, "launcher.nproc_per_node=64"]))
    assert "launcher.allow_oversubscribe=true" in one_line(err)
    with caplog.at_level(logging.WARNING):
        validate(compose_config([*ddp, "launcher.nproc_per_node=4"]))
        validate(
            compose_config(
                [*ddp, "launcher.nproc_per_node=64", "launcher.allow_oversubscribe=true"]
            )
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("share 2 usable core(s)" in w for w in warnings)


def test_fp32_overflow_stop_speaks_of_no_loss_scale():
    """error: gradients were not finite 3 steps in a row in: w; lower optimizer.lr, keep
    train.grad_clip > 0, or check the data for extreme values"""
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), float("nan"))
    scaler = disabled_loss_scaler(max_overflows_at_min_scale=3)
    for _ in range(2):
        assert overflow_checked_step(
            [weight.grad], 1.0, scaler, lambda: None, lambda: ["w"], torch.device("cpu"), 1
        ).skipped
    with pytest.raises(TrainingError, match="not finite 3 steps in a row in: w") as err:
        overflow_checked_step(
            [weight.grad], 1.0, scaler, lambda: None, lambda: ["w"], torch.device("cpu"), 1
        )
    assert "loss scale" not in one_line(err)


# --- 2. data --------------------------------------------------------------------------------


def files_config(path, tmp_path, tokenizer="byte") -> DataConfig:
    return DataConfig(
        name="files", path=str(path), cache_dir=str(tmp_path / "cache"), tokenizer=tokenizer
    )


def test_non_utf8_jsonl_line_is_named(tmp_path):
    """error: DIR/docs.jsonl:2 is not UTF-8 (byte 0xe9 at column 11); re-encode the file as
    UTF-8 or remove the line"""
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2 is not UTF-8 \(byte 0xe9") as err:
        prepare_data(files_config(path, tmp_path))
    assert "re-encode" in one_line(err)


def test_garbage_parquet_is_named(tmp_path):
    """error: DIR/rows.parquet is not a readable Parquet file (Parquet magic bytes not found
    ...); re-export it, or remove it from data.path"""
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["some text"] * 50}), good)
    (tmp_path / "rows.parquet").write_bytes(os.urandom(2048))
    with pytest.raises(DataError, match=r"rows\.parquet is not a readable Parquet file") as err:
        prepare_data(files_config(tmp_path, tmp_path))
    assert "re-export it" in one_line(err)


def test_malformed_tokenizer_json_is_named(tmp_path, text_corpus):
    """error: DIR/tokenizer.json is not a valid tokenizer.json (EOF while parsing ...); save
    it again with tokenizer.save_pretrained(DIR), or use data.tokenizer=bpe"""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {')
    with pytest.raises(DataError, match=r"tokenizer\.json is not a valid tokenizer\.json") as err:
        prepare_data(files_config(text_corpus, tmp_path, tokenizer=str(bad)))
    assert "save_pretrained" in one_line(err)


def test_binary_file_read_as_text_is_refused(tmp_path):
    """error: DIR/blob.txt is not UTF-8 text (N of M characters do not decode: binary, or
    another encoding); re-encode it as UTF-8 (iconv -t utf-8) or remove it from data.path"""
    (tmp_path / "notes.txt").write_text("plain text " * 100)
    (tmp_path / "blob.txt").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DataError, match=r"blob\.txt is not UTF-8 text") as err:
        prepare_data(files_config(tmp_path, tmp_path))
    assert "iconv" in one_line(err)


def test_corrupt_token_cache_is_rebuilt(tmp_path, text_corpus, caplog):
    """warning: token cache DIR is corrupt (train.offsets.npy does not match its xxh3_64
    checksum); rebuilding it"""
    cfg = files_config(text_corpus, tmp_path)
    first = np.asarray(prepare_data(cfg).train.tokens).copy()
    (offsets,) = (tmp_path / "cache").rglob("train.offsets.npy")
    data = bytearray(offsets.read_bytes())
    data[-8:] = b"\xff" * 8  # the last offset: same size, another value
    offsets.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg)
    assert any(
        "is corrupt" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records
    )
    assert np.array_equal(np.asarray(again.train.tokens), first)
    assert again.train.offsets[-1] == len(first)


def test_corrupt_cached_tokenizer_is_trained_again(tmp_path, text_corpus, caplog):
    """warning: tokenizer cache DIR/bpe-....json is corrupt (...); training it again"""
    cfg = DataConfig(
        name="files",
        path=str(text_corpus),
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        tokenizer_train_bytes=50_000,
    )
    first = prepare_data(cfg).tokenizer
    (cached,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    cached.write_text(cached.read_text()[:100])
    with caplog.at_level(logging.WARNING):
        again = prepare_data(cfg).tokenizer
    assert any("training it again" in r.getMessage() for r in caplog.records)
    assert again.digest == first.digest


# --- 3. checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_corpus, cache_dir):
    """A 4-step run with checkpoints at steps 2 and 4; tests work on copies of it."""
    out = tmp_path_factory.mktemp("faults") / "run"
    launch(compose_config(run_overrides(out, text_corpus, cache_dir, "train.max_steps=4")))
    return out


def run_overrides(out, text_corpus, cache_dir, *extra):
    return small_run_overrides(out, text_corpus, cache_dir, "checkpoint.every=2", *extra)


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def resume_run(out, text_corpus, cache_dir, *extra):
    cfg = compose_config(run_overrides(out, text_corpus, cache_dir, *extra))
    validate(cfg)
    return launch(cfg)


def flip_bytes_inside(path):
    """Same-size corruption: bits flipped in the middle, as a bad disk or copy leaves them."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def largest_data_file(checkpoint):
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def rewrite_checksum(checkpoint, name):
    """meta.json made to agree with a corrupted file (as if it were corrupted before being
    hashed), so that the load itself meets the corruption."""
    from llm.checksum import file_record

    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = file_record(checkpoint / name)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_same_size_corruption_is_caught_at_load(run_copy, text_corpus, cache_dir):
    """error: checkpoint DIR/step_000004 is corrupt: __0_0.distcp does not match its xxh3_64
    checksum; resume from the previous one with checkpoint.resume=DIR/step_000002"""
    newest = run_copy / "checkpoints/step_000004"
    flip_bytes_inside(largest_data_file(newest))
    with pytest.raises(CheckpointError, match="does not match its xxh3_64 checksum") as err:
        resume_run(
            run_copy, text_corpus, cache_dir, "train.max_steps=6", f"checkpoint.resume={newest}"
        )
    assert f"checkpoint.resume={run_copy / 'checkpoints/step_000002'}" in one_line(err)


def test_load_errors_name_the_file(run_copy, text_corpus, cache_dir):
    """error: checkpoint DIR/step_000004 is corrupt: trainer.pt: UnpicklingError: ...;
    resume from the previous one with checkpoint.resume=DIR/step_000002
    (and DCP's CheckpointException, a BaseException, ends the same way)"""
    newest = run_copy / "checkpoints/step_000004"
    resume = ["train.max_steps=6", f"checkpoint.resume={newest}"]
    (newest / "trainer.pt").write_bytes(b"not a pickle" * 10)
    rewrite_checksum(newest, "trainer.pt")
    with pytest.raises(CheckpointError, match=r"step_000004 is corrupt: trainer\.pt: ") as err:
        resume_run(run_copy, text_corpus, cache_dir, *resume)
    assert "step_000002" in one_line(err)
    data_file = largest_data_file(newest)
    data = bytearray(data_file.read_bytes())
    for i in range(0, len(data), 997):  # through DCP's own record headers too
        data[i] ^= 0xFF
    data_file.write_bytes(bytes(data))
    rewrite_checksum(newest, data_file.name)
    with pytest.raises(CheckpointError, match="step_000004 is corrupt: rank 0: ") as err:
        resume_run(run_copy, text_corpus, cache_dir, *resume)
    one_line(err)


def test_auto_resume_skips_a_corrupt_newest_checkpoint(run_copy, text_corpus, cache_dir, capsys):
    """skipped checkpoint DIR/step_000004: it is corrupt (__0_0.distcp does not match its
    xxh3_64 checksum); trying the one before it
    (then metrics.jsonl holds each step once: rows after step 2 go to
    metrics.rolled_back.jsonl, the earlier summary.json to summary.previous.json)"""
    newest = run_copy / "checkpoints/step_000004"
    flip_bytes_inside(largest_data_file(newest))
    before = read_metrics(run_copy)
    assert resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=4")["steps"] == 4
    err = capsys.readouterr().err.replace("\n", "")
    assert f"skipped checkpoint {newest}: it is corrupt" in err
    assert "step_000002 at step 2" in err
    # The corrupt checkpoint is set aside, not deleted, and no longer the newest.
    assert (run_copy / "checkpoints/rolled_back/step_000004").is_dir()
    assert [m["step"] for m in read_metrics(run_copy) if "loss" in m] == [1, 2, 3, 4]
    side = (run_copy / "metrics.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in side] == [m for m in before if m["step"] > 2]
    assert (run_copy / "summary.previous.json").is_file()


def test_resume_from_a_run_directory(run_copy, text_corpus, cache_dir, capsys, tmp_path):
    """error: checkpoint.resume=DIR holds no checkpoint; give a checkpoint folder (step_N,
    with meta.json), a run directory or its checkpoints/ folder, or auto / none"""
    out = tmp_path / "next"
    summary = resume_run(
        out, text_corpus, cache_dir, "train.max_steps=5", f"checkpoint.resume={run_copy}"
    )
    assert summary["steps"] == 5
    assert "step_000004 at step 4" in capsys.readouterr().err.replace("\n", "")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint") as err:
        resume_run(out, text_corpus, cache_dir, f"checkpoint.resume={empty}")
    assert "or delete" not in one_line(err)


def test_nan_after_resume_names_the_checkpoint(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: loss is nan at step 5: ...; this run resumed from DIR/step_000004, which may
    hold the cause: resume from an earlier checkpoint (checkpoint.resume=PATH) or start
    fresh (checkpoint.resume=none)"""
    real = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan")
    )
    with pytest.raises(TrainingError, match="loss is nan at step 5") as err:
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=6")
    assert f"resumed from {run_copy / 'checkpoints/step_000004'}" in one_line(err)


# --- 4. disk full ---------------------------------------------------------------------------


def test_disk_full_mid_write(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: no space left on DIR/checkpoints (N MB free, a checkpoint needs about M MB);
    free space there or point hydra.run.dir at a disk with room, then run the same command
    to resume (the newest checkpoint, step_000004, is kept)"""
    from llm.train import checkpoint as checkpoint_module

    real_save = dcp.save

    def save_until_full(*args, **kwargs):
        real_save(*args, **kwargs)  # a partial write takes up space
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_until_full)
    with pytest.raises(
        LabError,
        match=r"no space left on .*checkpoints \(\d+ MB free, a checkpoint needs about \d+ MB\)",
    ) as err:
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=5")
    assert "step_000004, is kept" in one_line(err)
    assert isinstance(err.value, OSError)
    left = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    assert left == ["step_000002", "step_000004"]  # no partial .step_000005.tmp
    checker = checkpoint_module.Checkpointer(run_copy / "checkpoints", 2, "", 1)
    assert checker.problem(run_copy / "checkpoints/step_000004") is None  # intact


def test_disk_full_is_found_before_writing(run_copy, text_corpus, cache_dir, monkeypatch):
    """error: no space left on DIR/checkpoints (1 MB free, a checkpoint needs about M MB);
    ... (the newest checkpoint, step_000004, is kept)"""
    from llm import disk
    from llm.train import checkpoint as checkpoint_module

    monkeypatch.setattr(disk, "free_bytes", lambda directory: 1 << 20)
    monkeypatch.setattr(checkpoint_module, "free_bytes", lambda directory: 1 << 20)
    with pytest.raises(LabError, match=r"\(1 MB free, a checkpoint needs about \d+ MB\)"):
        resume_run(run_copy, text_corpus, cache_dir, "train.max_steps=5")
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004",
    ]


def test_disk_full_in_the_metrics_writer(tmp_path):
    """error: no space left on DIR (N MB free); free space there or point hydra.run.dir at a
    disk with room, then run the same command to resume"""
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
    with pytest.raises(LabError, match=rf"no space left on {tmp_path} \(\d+ MB free") as err:
        logger.log(1, {"loss": 1.0})
    assert err.value.__cause__ is None and err.value.__context__ is not None
    one_line(err)
    logger.close()  # the refused buffer is not reported a second time


# --- 5. two runs, one directory -------------------------------------------------------------


def test_a_second_run_in_a_live_run_directory_is_refused(tmp_path, text_corpus, cache_dir):
    """error: run directory DIR is in use by another run (PID 1234 on host HOST); wait for it
    to finish or stop it, or give this run its own hydra.run.dir"""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from llm.run_dir_lock import RunDirLock; RunDirLock(sys.argv[1]).acquire();"
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
        cfg = compose_config(run_overrides(out, text_corpus, cache_dir))
        with pytest.raises(
            ConfigError, match=rf"PID {holder.pid} on host {socket.gethostname()}"
        ) as err:
            launch(cfg)
        assert "its own hydra.run.dir" in one_line(err)
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()  # the kernel frees the lock of a killed holder
        holder.wait()
    from llm.run_dir_lock import RunDirLock

    with RunDirLock(out):
        pass


# --- 6. several ranks -----------------------------------------------------------------------
# The launcher's own behaviour runs fast on stand-in ranks (tests/rank_stubs.py); the same
# through train.py with real training ranks is in make test-slow.


def stub_config(tmp_path):
    return compose_config(
        [f"output_dir={tmp_path}", "parallelism=ddp", "launcher.nproc_per_node=2"]
    )


def test_ctrl_c_waits_for_the_ranks_checkpoint(tmp_path):
    """stopped: interrupted (Ctrl-C); the newest checkpoint is DIR/checkpoints/step_000003:
    run the same command to resume from it   (train.py exits 130)"""
    import threading

    import rank_stubs

    from llm.launch import _spawn

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


def test_a_failing_rank_shows_its_own_error(tmp_path):
    """error: rank 1 failed: RuntimeError: injected fault on rank 1 (traceback:
    DIR/.rank_errors/rank1.txt)"""
    import rank_stubs

    from llm.launch import _spawn

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
    from llm.rank_failures import rank_failure, record_rank_failure

    # Rank 0 then failed on losing its peer; the kill is the cause the user must see.
    record_rank_failure(tmp_path, 0, "rank 0 failed: DistBackendError: connection closed", "tb")
    message = rank_failure(tmp_path, 1, -9, "SIGKILL")
    assert message.startswith("rank 1 was killed by SIGKILL") and "dmesg" in message
    assert rank_failure(tmp_path, 0, 1, None).startswith("rank 0 failed: DistBackendError")
