"""A rank under torchrun: noticing that its agent is gone, and naming a lost node.

torchrun starts each rank as a child of its node's agent, in a session of its own, so an
agent that dies alone (``kill -9`` on its process group, a crash, the OOM killer) leaves its
ranks running as orphans: training on with their peers, holding the node's devices, with no
agent left to restart or stop them. And when a whole node goes, the other nodes' ranks fail
on a closed connection ("Connection closed by peer [10.0.0.7]:41231") that names no node,
nor does torchrun's report.

Under torchrun (``TORCHELASTIC_RUN_ID`` set; never otherwise) a daemon thread, every
``BEAT_S`` seconds:

- compares ``os.getppid()`` with the agent's pid recorded at start; once they differ it
  writes one line and ends the process at once (the main thread may be blocked in a
  collective that never returns), so its peers fail too and their agents see it;
- across nodes (``GROUP_WORLD_SIZE > 1``), beats in the ranks' store (at
  MASTER_ADDR:MASTER_PORT, on node 0: its agent hosts it, or its rank 0 does under
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a counter with this rank's node, host and agent pid.

When a rank then fails, it waits ``VERDICT_BEATS`` beats, and the ranks whose counters did
not move are named, by node, in its one-line error (which torchrun's report carries); a
store that no longer answers names node 0. Cost: one small store write per rank per beat;
``VERDICT_BEATS`` beats more before a failed rank exits.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

from llm.errors import LabError, TrainingError
from llm.parallel.dist import RankEnv

BEAT_S = 1.0
VERDICT_BEATS = 3
_KEY = "llm/beat/{}"
# The agent that started this process: taken as early as train.py imports us (through
# llm.launch.launcher), so an agent lost during start-up is noticed too.
_PARENT_AT_START = os.getppid()
log = logging.getLogger(__name__)


class AgentWatch:
    def __init__(self, env: RankEnv, environ: Mapping[str, str]) -> None:
        self.env = env
        self.agent_pid = _PARENT_AT_START
        self.node = int(environ.get("GROUP_RANK", 0))
        self.nodes = int(environ.get("GROUP_WORLD_SIZE", 1))
        self.store_addr = (environ.get("MASTER_ADDR", env.master_addr), env.master_port)
        # Node 0's agent hosts the ranks' store (torch's default), or its rank 0 does
        # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): then it may not be up yet at our start.
        self.store_host = (
            "torchrun agent" if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
        )
        self.beat_s = BEAT_S
        self._identity = f"{self.node} {socket.gethostname()} {self.agent_pid}"
        self._count = 0
        self._store = None  # our client of the ranks' store, once connected
        self._store_lost = False  # a beat failed: the store's node is gone
        self._lock = threading.Lock()  # one store operation at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            if os.getppid() != self.agent_pid:
                self._orphaned()
            if self.nodes > 1 and not self._store_lost:
                self._beat()
            if self._stop.wait(self.beat_s):
                return

    def _beat(self) -> None:
        import torch.distributed as dist

        try:
            if self._store is None:  # retried each beat until the store is up
                host, port = self.store_addr
                store = dist.TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=self.beat_s)
                )
                store.set_timeout(timedelta(seconds=10))
            else:
                store = self._store
            # Kept before the first beat is visible: a rank that fails once its key exists
            # must find the store to read the other ranks' beats.
            self._store = store
            self._count += 1
            with self._lock:
                store.set(_KEY.format(self.env.rank), f"{self._count} {self._identity}")
        except Exception:
            # Not up yet (never beat: not watching), or gone (lost_peers() says so).
            self._store_lost = self._store is not None

    def _orphaned(self) -> None:
        line = (
            f"error: rank {self.env.rank} stopped: its torchrun agent (pid {self.agent_pid}, "
            f"node {self.node}) is gone, and no agent would stop or restart this rank\n"
        )
        os.write(sys.stderr.fileno(), line.encode())
        os._exit(1)

    def lost_peers(self) -> str | None:
        """Which ranks stopped beating, by node; None when every rank still beats, or this
        rank never reached the store, or this is one node (torchrun's own report names a
        lost local rank)."""
        if self._store is None:
            return None
        host, port = self.store_addr
        try:
            if self._store_lost:
                raise ConnectionError
            before = self._read_beats()
            time.sleep(VERDICT_BEATS * self.beat_s)
            after = self._read_beats()
        except Exception:
            return (
                f"lost node 0 (host {host}): the ranks' store its {self.store_host} hosted at "
                f"{host}:{port} does not answer"
            )
        lost: dict[str | None, list[int]] = {}
        for rank, beat in after.items():
            if beat is None or beat == before[rank]:
                node = beat.split(" ", 1)[1] if beat else None
                lost.setdefault(node, []).append(rank)
        if not lost:
            return None
        named = "; ".join(_describe(node, ranks) for node, ranks in lost.items())
        return f"lost {named}: no heartbeat in {VERDICT_BEATS * self.beat_s:g} s"

    def _read_beats(self) -> dict[int, str | None]:
        beats = {}
        with self._lock:
            for rank in range(self.env.world_size):
                key = _KEY.format(rank)
                beats[rank] = self._store.get(key).decode() if self._store.check([key]) else None
        return beats


def _describe(node: str | None, ranks: list[int]) -> str:
    listed = ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))
    if node is None:
        return f"{listed}, which never reported"
    number, host, agent = node.split(" ")
    return f"{listed} on node {number} (host {host}, torchrun agent pid {agent})"


def _warn_about_restarts(environ: Mapping[str, str]) -> None:
    """Under ``--max-restarts N``, what would keep a restart from resuming.

    Hydra names the default run directory by the time each process starts, so a restarted
    rank 0 would train from step 0 in a new directory; checkpoint.resume=auto resumes only
    where the run directory is given (as for a requeued Slurm job).

    torch 2.13's c10d rendezvous keeps the store its node-0 agent hosts for the ranks
    across restarts, keys and all, with nothing per round in them: restarted ranks can read
    the previous round's addresses and fail to connect (two-node restarts failed so 8 times
    in 10 here; pytorch/pytorch#135712). Opted out of, rank 0 hosts a fresh store each
    round (all passed)."""
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts == 0:
        return
    if not _run_dir_given():
        log.warning(
            "torchrun --max-restarts %d: restarted ranks resume only in the same run "
            "directory; give it (hydra.run.dir=DIR, the same on every node), or a restart "
            "starts again from step 0 in a new timestamped one",
            restarts,
        )
    shared = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(environ.get("GROUP_WORLD_SIZE", 1)) > 1:
        log.warning(
            "torchrun --max-restarts %d across nodes with the agent's shared store: restarted "
            "ranks may read the previous round's addresses and fail to connect; set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node",
            restarts,
        )


def _run_dir_given() -> bool:
    """Whether train.py's command line names the run directory (True outside train.py)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    overrides = HydraConfig.get().overrides
    given = ("hydra.run.dir=", "output_dir=")
    return any(o.startswith(given) for o in [*overrides.hydra, *overrides.task])


@contextmanager
def watch_agent(env: RankEnv, environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around a rank's run: under torchrun, watch its agent, and turn a failure caused by a
    lost node into one line that names it. Anything else passes through unchanged."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        yield
        return
    if env.rank == 0:
        _warn_about_restarts(environ)
    watch = AgentWatch(env, environ)
    watch.start()
    try:
        yield
    except (LabError, SystemExit, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        lost = watch.lost_peers()
        if lost is None:
            raise
        from llm.train.checkpoint import describe

        raise TrainingError(
            f"rank {env.rank} {lost}; training cannot go on ({describe(exc)})"
        ) from exc
    finally:
        watch.stop()
