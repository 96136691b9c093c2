"""Data preparation across ranks: once per node, or once in all when the cache is shared.

A rank's data comes from its own ``data.cache_dir``. Whether two ranks share that folder is
found out, not assumed: global rank 0 writes a marker named by a fresh token into its cache
folder and then sends the token to every rank; a rank that finds the marker in its own
folder shares rank 0's. So the folder is prepared by:

- global rank 0, for itself and every rank that sees its marker;
- each node's local rank 0 that does not see it (a node-local cache), for its node.

Every other rank waits for its preparer's ``<token>.ready`` (or ``.failed``) file in its own
folder, polling. A node-local preparer that missed the marker on a shared folder (a network
file system's attribute cache can hide a new file for a while) prepares too: harmless, since
each cache file is built under a file lock and renamed into place (llm/data/cache.py,
tokenizer.py), so it finds rank 0's files and loads them.

No rank waits for the preparation inside a collective with a fixed timeout. Preparers work
on a thread; meanwhile every rank's main thread takes part, at least once a second, in a
small all-reduce of who is ready on a gloo group of its own whose timeout is
``launcher.timeout_min``. So a preparation may take hours, while a rank whose process dies
or whose main thread hangs stops the others within ``launcher.timeout_min``, and no rank
reaches the run's next collective until every rank has its data. Ranks still waiting
``launcher.timeout_min`` after every preparer finished (a folder nobody prepares) stop
with one line. Rank 0 prints a progress line every ``PROGRESS_S``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from llm.config import DataConfig
from llm.data.corpora import cache_root
from llm.data.prepare import PreparedData, prepare_data
from llm.errors import DataError

log = logging.getLogger(__name__)

MARKERS = ".runs"  # under the cache folder: the marker and ready files of running starts
POLL_S = 1.0  # at most this long between two of the wait's all-reduces
FILE_POLL_S = 0.05
PROGRESS_S = 30.0
PREPARING, READY, FAILED = 0, 1, 2


class _Preparation:
    """``prepare_data`` on a thread of its own, its outcome marked in the cache folder for
    the ranks that wait on it."""

    def __init__(self, cfg: DataConfig, markers: Path, token: str) -> None:
        self.markers, self.token = markers, token
        self.data: PreparedData | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(cfg,), name="prepare-data", daemon=True
        )
        self._thread.start()

    def _run(self, cfg: DataConfig) -> None:
        try:
            self.data = prepare_data(cfg)
            (self.markers / f"{self.token}.ready").touch()
        except BaseException as exc:  # handed to the main thread, which raises it
            self.error = exc
            # Unwritten (a full disk), the waiters stop once every preparer is done.
            with contextlib.suppress(OSError):
                (self.markers / f"{self.token}.failed").write_text(str(exc))

    def status(self) -> int:
        if self._thread.is_alive():
            return PREPARING
        return FAILED if self.error is not None else READY

    def settle(self, seconds: float) -> None:
        """Wait up to ``seconds``, less when the preparation ends sooner."""
        self._thread.join(seconds)

    def result(self) -> PreparedData:
        if self.error is not None:
            raise self.error
        return self.data


class _Wait:
    """A rank that loads what another rank prepares into its cache folder."""

    def __init__(self, cfg: DataConfig, markers: Path, token: str) -> None:
        self.cfg, self.markers, self.token = cfg, markers, token
        self.data: PreparedData | None = None
        self.error: str | None = None

    def status(self) -> int:
        if self.data is None and self.error is None:
            failed = self.markers / f"{self.token}.failed"
            if failed.exists():
                self.error = failed.read_text()
            elif (self.markers / f"{self.token}.ready").exists():
                try:
                    self.data = prepare_data(self.cfg)  # loads the caches: nothing to build
                except Exception as exc:  # every rank must go on to the next poll
                    self.error = str(exc)
        if self.error is not None:
            return FAILED
        return PREPARING if self.data is None else READY

    def settle(self, seconds: float) -> None:
        """Poll the preparer's files for up to ``seconds``, less once either appears."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not any(
            (self.markers / f"{self.token}.{end}").exists() for end in ("ready", "failed")
        ):
            time.sleep(FILE_POLL_S)

    def result(self) -> PreparedData:
        if self.error is not None:
            raise DataError(self.error)
        return self.data


def prepare_across_ranks(
    cfg: DataConfig, rank: int, local_rank: int, world: int, timeout_min: float
) -> PreparedData:
    """This rank's prepared data, prepared once per node or once in all (module docstring).
    Every rank of the process group calls it; alone, it is ``prepare_data``."""
    # A rehearsal's fake group (llm.rehearse) has no peers to share the work with, and
    # cannot make the gloo group below.
    if world == 1 or not dist.is_initialized() or dist.get_backend() == "fake":
        return prepare_data(cfg)
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_min))
    try:
        markers = cache_root(cfg) / MARKERS
        markers.mkdir(parents=True, exist_ok=True)
        token = _shared_token(markers, rank, group)
        shared = (markers / token).exists()
        if rank == 0 or (local_rank == 0 and not shared):
            if rank != 0:
                log.info("preparing the data on this node: %s is not rank 0's", markers.parent)
            work = _Preparation(cfg, markers, token)
        else:
            work = _Wait(cfg, markers, token)
        statuses = _wait_for_all(work, rank, world, group, timeout_min)
        if rank == 0 or isinstance(work, _Preparation):
            for path in markers.glob(f"{token}*"):
                path.unlink(missing_ok=True)
    finally:
        dist.destroy_process_group(group)
    if work.status() == FAILED:
        return work.result()  # raises this rank's own error, or its preparer's
    failed = [r for r, s in enumerate(statuses) if s == FAILED]
    if failed:
        raise DataError(
            f"data preparation failed on rank {', '.join(map(str, failed))}; its own line "
            "says why (fix that and start again)"
        )
    return work.result()


def _shared_token(markers: Path, rank: int, group: dist.ProcessGroup) -> str:
    """A token fresh to this start, whose marker rank 0 wrote before sending it: a rank that
    then finds the marker in its folder shares rank 0's."""
    token = [None]
    if rank == 0:
        token[0] = uuid.uuid4().hex
        (markers / token[0]).touch()
    dist.broadcast_object_list(token, src=0, group=group)
    return token[0]


def _wait_for_all(
    work, rank: int, world: int, group: dist.ProcessGroup, timeout_min: float
) -> list[int]:
    """Every rank's status once none is still preparing: an all-reduce at least every
    POLL_S (sooner when this rank's status changes), each waiting only as long as the
    slowest rank's poll, never for a preparation. Ranks still waiting launcher.timeout_min
    after every preparer finished wait for a folder nobody prepares: every rank stops, at
    the same poll (polls are counted, not timed)."""
    start = said = time.monotonic()
    orphaned_polls = 0
    while True:
        flags = torch.zeros(2, world, dtype=torch.int64)
        flags[0, rank] = work.status()
        flags[1, rank] = isinstance(work, _Preparation)
        dist.all_reduce(flags, group=group)
        statuses, preparers = flags.tolist()
        if PREPARING not in statuses:
            return statuses
        waiting = [r for r, s in enumerate(statuses) if s == PREPARING]
        orphaned_polls = 0 if any(preparers[r] for r in waiting) else orphaned_polls + 1
        if orphaned_polls * POLL_S > timeout_min * 60:
            raise DataError(
                f"rank {', '.join(map(str, waiting[:8]))} waited {timeout_min:g} min for data "
                "that no rank prepares into its data.cache_dir; give every rank of a node "
                "the same data.cache_dir (or raise launcher.timeout_min on a slow shared "
                "file system)"
            )
        now = time.monotonic()
        if rank == 0 and now - said >= PROGRESS_S:
            said = now
            log.info(
                "preparing the data: %d of %d ranks ready after %.0f s (waiting for rank %s)",
                world - len(waiting),
                world,
                now - start,
                ", ".join(map(str, waiting[:8])) + (" ..." if len(waiting) > 8 else ""),
            )
        work.settle(POLL_S)
