"""llm.launch.agent_watch in one process, on a real TCPStore: a lost node is named by its heartbeats
or by its store, and nothing is watched outside torchrun. The torchrun runs themselves (an
orphaned rank, a lost node, a restart) are in test_torchrun_nodes.py (slow)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from llm.errors import ConfigError, TrainingError
from llm.launch import agent_watch
from llm.launch.agent_watch import AgentWatch, watch_agent
from llm.launch.launcher import free_port
from llm.parallel.dist import RankEnv


@pytest.fixture
def fast_beats(monkeypatch):
    monkeypatch.setattr(agent_watch, "BEAT_S", 0.05)


def torchrun_environ(port: int, node: int) -> dict[str, str]:
    return {
        "TORCHELASTIC_RUN_ID": "test",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_env(rank: int, port: int) -> RankEnv:
    return RankEnv(rank, 0, 3, "127.0.0.1", port, init_method="env://")


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_nothing_is_watched_outside_torchrun():
    """No thread, and an error passes through at once, unchanged: a run not under torchrun
    (our launcher's ranks, Slurm, one process) never meets the watch."""
    before = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^boom$"), watch_agent(RankEnv(0, 0, 2), environ={}):
        assert not any(t.name == "agent-watch" for t in threading.enumerate())
        raise RuntimeError("boom")
    assert time.monotonic() - before < 0.5


def test_a_rank_whose_beats_stopped_is_named_by_node(fast_beats):
    """Ranks 0 (node 0) and 2 (node 1) beat; rank 1's last beat (node 1) never changes."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    store.set("llm/beat/1", "7 1 nodehost 4242")  # its last beat before it died
    watches = [
        AgentWatch(rank_env(0, port), torchrun_environ(port, 0)),
        AgentWatch(rank_env(2, port), torchrun_environ(port, 1)),
    ]
    for watch in watches:
        watch.start()
    try:
        wait_until(lambda: all(w._store is not None for w in watches))
        lost = watches[0].lost_peers()
    finally:
        for watch in watches:
            watch.stop()
    assert lost == "lost rank 1 on node 1 (host nodehost, torchrun agent pid 4242): " + (
        "no heartbeat in 0.15 s"
    )


def test_a_store_that_does_not_answer_names_node_0(fast_beats):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    watch = AgentWatch(rank_env(2, port), torchrun_environ(port, 1))
    watch.start()
    try:
        wait_until(lambda: watch._store is not None)
        del store  # node 0's agent, which hosted it, is gone
        wait_until(lambda: watch._store_lost)
        lost = watch.lost_peers()
    finally:
        watch.stop()
    assert lost == (
        f"lost node 0 (host 127.0.0.1): the ranks' store its torchrun agent hosted at "
        f"127.0.0.1:{port} does not answer"
    )


def test_a_failure_after_a_lost_node_becomes_one_line_naming_it(fast_beats):
    """The rank's own error is kept at the end of the line; our one-line errors and a
    failure while every rank still beats pass through unchanged."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    environ = torchrun_environ(port, 0)
    env = RankEnv(0, 0, 1, "127.0.0.1", port, init_method="env://")  # alone: all beat
    with pytest.raises(RuntimeError, match=r"^peer$"), watch_agent(env, environ):
        raise RuntimeError("peer")
    with pytest.raises(ConfigError), watch_agent(env, environ):
        raise ConfigError("one line")
    store.set("llm/beat/1", "3 1 nodehost 4242")
    store.delete_key("llm/beat/0")  # the watches above beat too, and may once after they end
    env = RankEnv(0, 0, 2, "127.0.0.1", port, init_method="env://")
    with pytest.raises(TrainingError) as err, watch_agent(env, environ):
        # Two changes of rank 0's beat after it reappears: at least one is this watch's.
        wait_until(lambda: store.check(["llm/beat/0"]))
        for _ in range(2):
            seen = store.get("llm/beat/0")
            wait_until(lambda seen=seen: store.get("llm/beat/0") != seen)
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert str(err.value) == (
        "rank 0 lost rank 1 on node 1 (host nodehost, torchrun agent pid 4242): no heartbeat "
        "in 0.15 s; training cannot go on (RuntimeError: Connection closed by peer "
        "[127.0.0.1]:1234)"
    )


def test_restarts_warn_about_what_would_keep_them_from_resuming(caplog):
    """Outside train.py the run directory counts as given: only the shared store is named,
    and only across nodes with restarts."""
    environ = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with caplog.at_level("WARNING", logger="llm.launch.agent_watch"):
        agent_watch._warn_about_restarts({**environ, "GROUP_WORLD_SIZE": "1"})
        agent_watch._warn_about_restarts({**environ, "TORCHELASTIC_MAX_RESTARTS": "0"})
        assert not caplog.records
        agent_watch._warn_about_restarts({**environ, "GROUP_WORLD_SIZE": "2"})
    (record,) = caplog.records
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in record.getMessage()
