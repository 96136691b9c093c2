"""The training loader, one thread ahead: the next batches are read (and on CUDA pinned)
while the step runs.

A background thread pulls up to ``depth`` batches from the loader ahead of the consumer,
pins them when a CUDA device is given, and queues each with the loader's state after it.
The consumer's ``next()`` waits on that queue only; the host-to-device copy stays with the
consumer (llm/train/trainer.py), on its stream. ``state_dict()`` is the state after the last
batch handed out, never after those read ahead, so a checkpoint resumes on exactly the next
batch the consumer would have taken. ``depth=0`` reads (and pins) on the consumer's thread,
with no thread at all.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import torch

from llm.data.dataset import Batch


class ResumableLoader(Protocol):
    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _Failed:
    """What the thread queues instead of a batch when the loader raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Worker:
    """One reading thread with its own queue, free slots and stop flag: nothing of a
    stopped thread's reaches the next one."""

    def __init__(self, fill, depth: int) -> None:
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.slots = threading.Semaphore(depth)  # batches it may read before the next get
        self.stop = threading.Event()
        # A daemon: never keeps the interpreter from exiting.
        self.thread = threading.Thread(target=fill, args=(self,), name="llm-prefetch", daemon=True)
        self.thread.start()

    def end(self) -> None:
        self.stop.set()
        self.slots.release()  # wakes the thread if it waits for a free slot
        self.thread.join()


class Prefetcher:
    """An endless iterator of Batch over ``loader``, ``depth`` batches read ahead; resumable
    like the loader. ``pin_device``: the CUDA device the batches go to (pinned for it), or
    None (CPU: nothing to pin). ``close()`` stops the thread; ``next()`` starts it again."""

    def __init__(
        self, loader: ResumableLoader, depth: int, pin_device: torch.device | None = None
    ) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.loader, self.depth, self.pin_device = loader, depth, pin_device
        self._consumed = loader.state_dict()  # the loader's state after the last batch out
        self._worker: _Worker | None = None

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        if self.depth == 0:
            batch = self._pinned(next(self.loader))
            self._consumed = self.loader.state_dict()
            return batch
        if self._worker is None:
            self._worker = _Worker(self._fill, self.depth)
        item = self._worker.ready.get()
        if isinstance(item, _Failed):
            self.close()
            # The loader's own exception, its traceback from the thread intact: a DataError
            # still reads as its one line.
            raise item.error
        self._worker.slots.release()
        batch, self._consumed = item
        return batch

    def state_dict(self) -> dict:
        return dict(self._consumed)

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``: what was read ahead is dropped."""
        self.close()
        self.loader.load_state_dict(state)
        self._consumed = self.loader.state_dict()

    def close(self) -> None:
        """Stop the thread, drop what it read ahead and rewind the loader to the last batch
        handed out, so that a later ``next()`` goes on from there."""
        if self._worker is None:
            return
        self._worker.end()
        self._worker = None
        self.loader.load_state_dict(self._consumed)

    def _fill(self, worker: _Worker) -> None:
        try:
            if self.pin_device is not None:
                # A new thread's current device is cuda:0: pinning from there would open a
                # context, and hold memory, on another rank's GPU.
                torch.cuda.set_device(self.pin_device)
            while True:
                worker.slots.acquire()
                if worker.stop.is_set():
                    return
                batch = next(self.loader)
                worker.ready.put((self._pinned(batch), self.loader.state_dict()))
        except BaseException as error:  # raised on the consumer's thread, not printed here
            worker.ready.put(_Failed(error))

    def _pinned(self, batch: Batch) -> Batch:
        """On CUDA, the batch in page-locked memory, so its copy to the device can be
        asynchronous; on CPU, the batch itself."""
        if self.pin_device is None:
            return batch
        return Batch(*(None if t is None else t.pin_memory() for t in batch))
