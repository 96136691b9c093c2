"""A hung collective ends in one line naming it (llm/parallel/hangs.py): the process group's
timeout is launcher.timeout_min, NCCL's flight recorder is on for every run, and the line
names the collective and where the dumps are.

On gloo a collective that times out raises in its Python call, which is what these tests
show with two real ranks and a 2-second timeout. What only a GPU shows: NCCL's watchdog
aborting a rank (SIGABRT) and writing the dumps; here the dumps are written by hand in the
format torch's reader takes (``entries`` with ``profiling_name``, ``collective_seq_id``,
``state``)."""

from __future__ import annotations

import os
import pickle
import re
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from llm.launch import launcher
from llm.launch.rank_failures import rank_failure
from llm.parallel.dist import RankEnv, init_distributed
from llm.parallel.hangs import collective_timeout, trace_prefix, waiting_in

TIMEOUT_MIN = 2 / 60  # gloo says it in milliseconds: 2000ms


def _disagreeing_rank(rank: int, port: int, out: str) -> None:
    """Rank 0 all-reduces while rank 1 broadcasts: neither completes. Each writes what it
    raised and keeps the process group until the other has too."""
    import torch.distributed as dist

    env = RankEnv(rank, rank, 2, "127.0.0.1", port)
    init_distributed(env, torch.device("cpu"), "gloo", True, TIMEOUT_MIN)
    line = "completed"
    try:
        t = torch.ones(1)
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=1)
    except RuntimeError as exc:
        # not a timeout (None): what it was instead
        line = collective_timeout(exc, rank, TIMEOUT_MIN, trace_prefix(Path(out))) or str(exc)
    Path(out, f"rank{rank}.txt").write_text(line)
    while not Path(out, f"rank{1 - rank}.txt").exists():
        time.sleep(0.05)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks: 72-82 s on 2 cores shared with other jobs
def test_a_timed_out_collective_is_one_line_naming_it(tmp_path):
    """The rank that times out first says so; gloo then closes its connections, so the
    other may see "connection closed by peer" instead, which is not called a timeout (the
    launcher reports the earliest failure: the timeout)."""
    mp.start_processes(
        _disagreeing_rank,
        args=(launcher.free_port(), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    prefix = tmp_path / "nccl_trace_rank_"
    timed_out = 0
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    for rank, (collective, line) in enumerate(zip(("all_reduce", "broadcast"), lines, strict=True)):
        if "Connection closed by peer" in line:
            continue
        timed_out += 1
        assert "\n" not in line
        # launcher.timeout_min reached the process group: gloo waited 2000 ms
        assert re.match(
            rf"rank {rank}: collective {collective} timed out \(Timed out waiting 2000ms for "
            r"(recv|send) operation to complete; launcher.timeout_min=0.0333333\): ",
            line,
        ), lines
        assert f"dumped to {prefix}N" in line
        assert f"fr_trace {tmp_path} --prefix nccl_trace_rank_" in line
    assert timed_out >= 1, lines


def test_other_errors_are_not_called_timeouts():
    try:
        torch.ones(2) @ torch.ones(3)
    except RuntimeError as exc:
        assert collective_timeout(exc, 0, 10, Path("/x/nccl_trace_rank_")) is None


def _dump(path: Path, entries: list[tuple[str, int, str]]) -> None:
    rows = [{"profiling_name": n, "collective_seq_id": s, "state": st} for n, s, st in entries]
    path.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": rows}))


def test_an_aborted_rank_names_the_collective_each_rank_was_in(tmp_path):
    """What the launcher says when NCCL's watchdog aborted a rank (SIGABRT) after dumping."""
    prefix = trace_prefix(tmp_path)
    assert waiting_in(prefix) is None
    _dump(tmp_path / "nccl_trace_rank_0", [("nccl:all_reduce", 11, "completed"),
                                           ("nccl:all_reduce", 12, "started")])  # fmt: skip
    _dump(tmp_path / "nccl_trace_rank_1", [("nccl:all_reduce", 11, "completed"),
                                           ("nccl:broadcast", 12, "scheduled")])  # fmt: skip
    line = rank_failure(tmp_path / ".rank_errors", 1, -6, "SIGABRT", str(prefix))
    assert line == (
        "rank 1 was aborted by NCCL's watchdog: a collective timed out (launcher.timeout_min) "
        "with rank 0 in nccl:all_reduce #12, rank 1 in nccl:broadcast #12; every rank's last "
        f"collectives are in {prefix}N (python -m torch.distributed.flight_recorder.fr_trace "
        f"{tmp_path} --prefix nccl_trace_rank_)"
    )
    # without dumps, a SIGABRT is named as any other signal
    assert "killed by SIGABRT" in rank_failure(tmp_path / "e", 1, -6, "SIGABRT", "/none/x_")


def test_the_flight_recorder_is_on_unless_the_user_set_it(tmp_path, monkeypatch):
    names = (
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
    )
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher, "_FLIGHT_RECORDER_SET", {})
    assert launcher.enable_flight_recorder(tmp_path / "a") == str(tmp_path / "a/nccl_trace_rank_")
    assert [os.environ[n] for n in names[:2]] == ["2000", "1"]
    # the next job of this process (a sweep) dumps into its own folder
    assert launcher.enable_flight_recorder(tmp_path / "b") == str(tmp_path / "b/nccl_trace_rank_")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/mine/fr_")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    assert launcher.enable_flight_recorder(tmp_path / "c") == "/mine/fr_"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
