"""The training loader read ahead on a thread (llm/data/prefetch.py): the same batches as
reading them on demand, a resume that starts after the batches consumed (not those read
ahead), the loader's errors raised where the batch was asked for, a bounded read-ahead, a
clean stop, and a data wait that is the wait on the queue."""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np
import pytest
import torch
from helpers import compose_config, one_line, run, small_run_overrides, train_losses

from llm.config import DataConfig
from llm.data.dataset import TokenDataset
from llm.data.loader import TrainLoader
from llm.data.prefetch import Prefetcher
from llm.errors import ConfigError, DataError
from llm.launch.launcher import launch
from llm.train.metrics import StepTimer
from llm.train.trainer import Trainer

# A batch the thread never hands over would hang the consumer: fail in minutes, not at the
# suite's 10-minute limit.
pytestmark = pytest.mark.timeout(120)


def train_loader(seed: int = 3) -> TrainLoader:
    """Tokens 0..1999 in 10 documents: 124 packed samples of 16, 8 per batch, 15 batches an
    epoch, so 40 batches cross two epoch boundaries."""
    tokens = np.arange(2000, dtype=np.int64)
    offsets = np.linspace(0, 2000, 11).astype(np.int64)
    return TrainLoader(TokenDataset(tokens, offsets, eos_id=-1), 16, True, 8, 0, 1, seed=seed)


class Counting:
    """A loader that counts the batches pulled from it, sleeps ``seconds`` per batch, and
    raises ``error`` at pull number ``fail_at`` (from 1)."""

    def __init__(self, loader, seconds: float = 0.0, fail_at: int = 0, error=None) -> None:
        self.loader, self.seconds, self.fail_at, self.error = loader, seconds, fail_at, error
        self.pulled = 0

    def __next__(self):
        time.sleep(self.seconds)
        self.pulled += 1
        if self.pulled == self.fail_at:
            raise self.error
        return next(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def take(loader, n: int) -> list:
    return [next(loader) for _ in range(n)]


def assert_same_batches(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.targets, y.targets)
        assert torch.equal(x.doc_ids, y.doc_ids)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "llm-prefetch"]


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the prefetch thread did not get there"
        time.sleep(0.005)


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_the_batches_and_states_are_those_read_on_demand(depth):
    plain, ahead = train_loader(), Prefetcher(train_loader(), depth)
    for _ in range(40):
        assert_same_batches([next(plain)], [next(ahead)])
        assert ahead.state_dict() == plain.state_dict()  # consumed, not read ahead
    assert ahead.state_dict()["epoch"] == 2
    ahead.close()


def test_depth_zero_reads_on_the_callers_thread():
    source = Counting(train_loader())
    take(Prefetcher(source, 0), 5)
    assert source.pulled == 5 and not prefetch_threads()


@pytest.mark.parametrize("depth", [1, 3])
def test_the_thread_reads_at_most_depth_batches_ahead(depth):
    source = Counting(train_loader())
    ahead = Prefetcher(source, depth)
    for consumed in range(1, 8):
        next(ahead)
        wait_for(lambda n=consumed + depth: source.pulled == n)  # it does read ahead...
        time.sleep(0.02)
        assert source.pulled == consumed + depth  # ...and no further
    ahead.close()


def test_a_resume_starts_after_the_batches_consumed():
    source = Counting(train_loader())
    ahead = Prefetcher(source, 3)
    take(ahead, 7)
    wait_for(lambda: source.pulled == 10)
    state = ahead.state_dict()
    expected = take(ahead, 10)
    resumed = Prefetcher(train_loader(seed=999), 3)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 10), expected)
    # On a running prefetcher, load_state_dict drops what was read ahead.
    plain = train_loader()
    take(plain, 2)
    ahead.load_state_dict(plain.state_dict())
    assert_same_batches(take(ahead, 5), take(plain, 5))
    ahead.close()
    resumed.close()


def test_close_stops_the_thread_and_next_goes_on_from_the_last_batch_out():
    plain, ahead = train_loader(), Prefetcher(train_loader(), 2)
    assert_same_batches(take(ahead, 3), take(plain, 3))
    (thread,) = prefetch_threads()
    ahead.close()
    assert not thread.is_alive() and not prefetch_threads()
    ahead.close()  # a second close is a no-op
    assert ahead.loader.state_dict() == plain.state_dict()  # rewound to the last batch out
    assert_same_batches(take(ahead, 3), take(plain, 3))
    ahead.close()


def test_a_loader_error_is_raised_on_the_consumers_thread(monkeypatch):
    printed = []  # what an uncaught exception in a thread would have printed
    monkeypatch.setattr(threading, "excepthook", printed.append)
    message = "token cache /x is corrupt (train.bin does not match its checksum); delete it"
    source = Counting(train_loader(), fail_at=4, error=DataError(message))
    plain, ahead = train_loader(), Prefetcher(source, 2)
    assert_same_batches(take(ahead, 3), take(plain, 3))  # the batches before the failure
    with pytest.raises(DataError) as err:
        next(ahead)
    assert one_line(err) == message
    # Its traceback still reaches into the loader, where it was raised.
    assert any(f.name == "__next__" for f in traceback.extract_tb(err.value.__traceback__))
    assert not prefetch_threads() and not printed
    assert ahead.state_dict() == plain.state_dict()


@pytest.mark.parametrize("depth", [0, 2])
def test_the_data_wait_is_the_wait_on_the_queue(depth):
    """Each batch takes 50 ms to read and each step 100 ms: read on demand, a third of a
    step waits for data; read ahead, only the first step does."""
    ahead = Prefetcher(Counting(train_loader(), seconds=0.05), depth)
    timer = StepTimer(torch.device("cpu"))
    for _ in range(6):
        with timer.step():
            with timer.data():
                next(ahead)
            time.sleep(0.1)
    ahead.close()
    shares = [t.data_wait_share for t in timer.collect()]
    if depth == 0:
        assert min(shares) > 0.25
    else:
        assert max(shares[1:]) < 0.05


def test_config_refuses_a_negative_depth():
    assert DataConfig().prefetch == 2
    with pytest.raises(ConfigError, match=r"data\.prefetch=-1 must be >= 0") as err:
        DataConfig(prefetch=-1)
    one_line(err)


# --- whole runs -----------------------------------------------------------------------------


def test_losses_are_bitwise_equal_with_and_without_read_ahead(tmp_path, text_corpus, cache_dir):
    args = ("train.max_steps=4", "train.grad_accum_steps=2")
    sync, out_sync = run(tmp_path, "sync", text_corpus, cache_dir, *args, "data.prefetch=0")
    ahead, out_ahead = run(tmp_path, "ahead", text_corpus, cache_dir, *args, "data.prefetch=2")
    assert train_losses(out_ahead) == train_losses(out_sync)  # bitwise on CPU in fp32
    assert len(train_losses(out_sync)) == 4
    assert sync["data_wait_share"] is not None and ahead["data_wait_share"] is not None
    assert not prefetch_threads()  # fit closed it


def test_a_resumed_run_sees_the_batches_of_an_unbroken_one(tmp_path, text_corpus, cache_dir):
    """The checkpoint at step 3 holds the loader state after step 3's batch, not after the
    two read ahead of it: the resumed run's steps 4-6 take the unbroken run's batches."""
    _, out_full = run(tmp_path, "full", text_corpus, cache_dir, "data.prefetch=2")
    out = tmp_path / "halves"
    for extra in ("train.stop_at_step=3", "checkpoint.resume=auto"):
        launch(compose_config(small_run_overrides(out, text_corpus, cache_dir, extra)))
    ref, got = train_losses(out_full), train_losses(out)
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert got[step] == ref[step], step  # bitwise on CPU in fp32


def test_a_loader_error_in_a_run_stays_its_one_line(tmp_path, text_corpus, cache_dir, monkeypatch):
    """Raised in the prefetch thread at the third training batch, the loader's DataError
    reaches the entry point as itself (train.py prints it as one line), and no thread is
    left behind."""
    message = "train.bin of the token cache changed while training; delete the cache"
    real_batch, calls = TokenDataset.batch, []

    def failing_batch(self, *args):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise DataError(message)
        return real_batch(self, *args)

    monkeypatch.setattr(TokenDataset, "batch", failing_batch)
    with pytest.raises(DataError) as err:
        run(tmp_path, "fails", text_corpus, cache_dir, "data.prefetch=2")
    assert one_line(err) == message
    assert set(calls) == {"llm-prefetch"} and not prefetch_threads()


def test_a_failing_step_leaves_no_thread(tmp_path, text_corpus, cache_dir, monkeypatch):
    """Trainer.fit closes the prefetcher whatever ends it: here an error in step 2, with
    batches read ahead of it."""
    real_step, steps = Trainer._step_on, []

    def failing_step(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("a step failed")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_step_on", failing_step)
    with pytest.raises(RuntimeError, match="a step failed"):
        run(tmp_path, "fails", text_corpus, cache_dir, "data.prefetch=2")
    assert not prefetch_threads()
