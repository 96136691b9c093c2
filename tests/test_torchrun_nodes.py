"""Multi-node torchrun on one host (`make test-slow`): two agents with ``--nnodes 2`` and a
c10d rendezvous on 127.0.0.1, as two machines would run them, training on CPU (gloo).

The agent that binds the rendezvous port hosts the c10d store (``is_host=1``; the other
passes ``is_host=0``); if it dies the other agent fails at once, whatever
``--max-restarts`` says. Each agent runs in a session of its own, and starts its ranks in
sessions of their own (torchrun does), so a node is killed as a cluster loses one: its agent
and its ranks together. Tests wait for markers (metrics rows, checkpoints, log lines), never
for fixed times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
from helpers import assert_run_matches, read_metrics, run, small_run_overrides

from llm.launch.launcher import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
GLOBAL_BATCH = 8  # sequences per step, on every layout compared here
LOST_BOUND_S = 60  # a lost node or agent must stop the other node's agent within this


class Node:
    """One torchrun agent (``--nnodes 2``), its output in ``<name>.log``."""

    def __init__(self, tmp_path, name, port, run_id, is_host, nproc, args, max_restarts, env):
        self.name = name
        self.log_path = tmp_path / f"{name}.log"
        cmd = [
            str(TORCHRUN),
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            f"is_host={int(is_host)},join_timeout=30",
            "--max-restarts",
            str(max_restarts),
            str(REPO / "train.py"),
            *args,
        ]
        with open(self.log_path, "w") as log:
            self.agent = subprocess.Popen(
                cmd,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, as on its own machine
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.agent.pid).children()

    def node_rank(self) -> int:
        """Its GROUP_RANK: the rendezvous numbers the nodes, not their start order."""
        return int(self.workers()[0].environ()["GROUP_RANK"])

    def kill_agent(self) -> None:
        os.killpg(self.agent.pid, signal.SIGKILL)

    def kill_node(self) -> None:
        """``kill -9`` on the agent's process group and on each rank's (torchrun starts each
        rank in a session of its own, so the agent's group alone leaves them running)."""
        workers = self.workers()
        self.kill_agent()
        for worker in workers:
            _killpg(worker.pid)


def _killpg(pid: int) -> None:
    with suppress(ProcessLookupError):  # already gone
        os.killpg(pid, signal.SIGKILL)


@contextmanager
def two_nodes(tmp_path, out, corpus, cache, nproc, *extra, max_restarts=0, env=None):
    """Two agents of one run (the rendezvous host first) training into ``out``, ``env`` added
    to their environment; on the way out, whatever is left of them, ranks included, is
    killed."""
    port, run_id = free_port(), f"llm-test-{os.getpid()}-{time.monotonic_ns()}"
    args = [
        *small_run_overrides(out, corpus, cache, *extra),
        "parallelism=ddp",
        f"train.micro_batch_size={GLOBAL_BATCH // (2 * nproc)}",
        "launcher=torchrun",
        f"hydra.run.dir={out}",
    ]
    nodes = [
        Node(tmp_path, name, port, run_id, name == "host", nproc, args, max_restarts, env or {})
        for name in ("host", "other")
    ]
    try:
        yield nodes
    finally:
        for node in nodes:
            _killpg(node.agent.pid)
            node.agent.wait()
        for proc in psutil.process_iter():  # orphaned ranks of this run
            try:
                if proc.environ().get("TORCHELASTIC_RUN_ID") == run_id:
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass


def wait_for(condition, what: str, nodes, timeout: float = 300.0):
    """Poll ``condition`` until it holds; fail early, with the logs, when an agent ends."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [n for n in nodes if n.agent.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(f"--- {n.name}:\n{n.log()[-3000:]}" for n in nodes)
            pytest.fail(f"no {what}: {'agent ended' if ended else 'timed out'}\n{logs}")
        time.sleep(0.05)


def logged_steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_exit(node: Node, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = node.agent.wait(timeout=timeout)
    return code, time.monotonic() - start


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, text_corpus, cache_dir):
    """``steps -> output directory`` of one process with the same global batch and seed."""
    runs = {}

    def get(steps: int) -> Path:
        if steps not in runs:
            tmp = tmp_path_factory.mktemp(f"single_{steps}")
            extra = (f"train.micro_batch_size={GLOBAL_BATCH}", f"train.max_steps={steps}")
            runs[steps] = run(tmp, "run", text_corpus, cache_dir, *extra)[1]
        return runs[steps]

    return get


@pytest.mark.parametrize("nproc", [1, 2])
def test_two_nodes_train_as_one_process(tmp_path, text_corpus, cache_dir, single_process, nproc):
    """2 nodes x ``nproc`` ranks: the losses, clipping norms and final weights of one
    process with the same global batch."""
    out = tmp_path / "run"
    with two_nodes(tmp_path, out, text_corpus, cache_dir, nproc) as nodes:
        for node in nodes:
            assert node.agent.wait(timeout=300) == 0, node.log()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 * nproc
    assert_run_matches(single_process(6), out, steps=6)


@pytest.mark.parametrize(("victim", "nproc"), [("other", 1), ("host", 2)])
def test_a_lost_node_stops_the_other_promptly(
    tmp_path, text_corpus, cache_dir, victim, nproc, capsys
):
    """kill -9 on one node (its agent and its ranks): the other agent exits, failed, within
    LOST_BOUND_S, and its ranks' line names the lost node. Whether the lost node hosted the
    ranks' store (node 0) or not (then its heartbeats stopped), the line says which."""
    out = tmp_path / "run"
    args = (text_corpus, cache_dir, nproc, "train.max_steps=100000")
    with two_nodes(tmp_path, out, *args) as nodes:
        wait_for(lambda: logged_steps(out) >= 2, "second step", nodes)
        lost, survivor = nodes if victim == "host" else nodes[::-1]
        lost_rank = lost.node_rank()
        lost.kill_node()
        code, took = wait_exit(survivor, LOST_BOUND_S)
    with capsys.disabled():
        print(f"\n{victim} node lost: the other agent exited {took:.1f} s after the kill")
    assert code != 0
    log = survivor.log()
    named = re.findall(rf"^error: rank \d+ lost .*node {lost_rank} \(host [^)]*\).*$", log, re.M)
    assert named, log[-4000:]
    if "store" not in named[0]:  # heartbeats: the lost agent's pid is named too
        assert f"torchrun agent pid {lost.agent.pid})" in named[0]


def test_an_orphaned_rank_stops_itself(tmp_path, text_corpus, cache_dir, capsys):
    """kill -9 on the other agent alone: its rank lives on, orphaned (torchrun started it in
    a session of its own), until it notices its agent is gone and stops with one line; the
    host agent then exits, naming the node whose rank went."""
    out = tmp_path / "run"
    with two_nodes(tmp_path, out, text_corpus, cache_dir, 1, "train.max_steps=100000") as nodes:
        host, other = nodes
        wait_for(lambda: logged_steps(out) >= 2, "second step", nodes)
        (rank,), node = other.workers(), other.node_rank()
        global_rank = int(rank.environ()["RANK"])
        killed = time.monotonic()
        other.kill_agent()
        other.agent.wait()
        rank.wait(timeout=LOST_BOUND_S)  # its line below says it outlived its agent
        stopped = time.monotonic() - killed
        code, took = wait_exit(host, LOST_BOUND_S)
    with capsys.disabled():
        print(
            f"\norphaned rank stopped {stopped:.1f} s after its agent's kill; the host "
            f"agent exited {took:.1f} s after that"
        )
    assert code != 0
    expected = (
        f"error: rank {global_rank} stopped: its torchrun agent (pid {other.agent.pid}, "
        f"node {node}) is gone"
    )
    assert expected in other.log(), other.log()[-3000:]
    assert f"lost rank {global_rank} on node {node} (host " in host.log(), host.log()[-3000:]


def test_a_killed_rank_is_restarted_and_resumes(
    tmp_path, text_corpus, cache_dir, single_process, capsys
):
    """--max-restarts 1: a rank killed mid-run is restarted by torchrun (every rank is: the
    other node's agent re-joins the rendezvous), the run resumes from its newest checkpoint,
    and ends with an uninterrupted run's losses and weights. The agents do not share their
    store with the ranks (torch 2.13 keeps it across restarts, stale keys and all: see
    llm.launch.agent_watch._warn_about_restarts); rank 0 then hosts a fresh one per round."""
    out, steps = tmp_path / "run", 16
    extra = (f"train.max_steps={steps}", "checkpoint.every=4", "checkpoint.keep_last=10")
    fresh_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with two_nodes(
        tmp_path, out, text_corpus, cache_dir, 1, *extra, max_restarts=1, env=fresh_store
    ) as nodes:
        step4 = out / "checkpoints" / "step_000004"
        wait_for(lambda: step4.is_dir() and logged_steps(out) >= 6, "checkpoint", nodes)
        (victim,) = nodes[1].workers()
        victim.kill()
        killed_at, at_step = time.time(), logged_steps(out)
        for node in nodes:
            assert node.agent.wait(timeout=300) == 0, node.log()[-3000:]
    logs = "".join(node.log() for node in nodes)  # rank 0's node says it
    resumed = set(re.findall(r"resumed from \S+/step_(\d+) at step", logs))
    assert len(resumed) == 1, logs[-3000:]
    resumed_step = int(resumed.pop())
    assert 4 <= resumed_step <= at_step < steps
    assert_run_matches(single_process(steps), out, steps=steps)
    first = next(m for m in read_metrics(out) if m["step"] == resumed_step + 1 and "loss" in m)
    recovery = first["time"] - killed_at
    with capsys.disabled():
        print(
            f"\nrank killed after step {at_step}; resumed from step {resumed_step}; "
            f"first step after the resume {recovery:.1f} s after the kill"
        )
    assert 0 < recovery < 300
