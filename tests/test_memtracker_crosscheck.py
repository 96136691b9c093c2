"""Our peak tracker (llm/memory/peak.py) against torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker`` for FSDP2), both
open around the same training step of gpt2-tiny, so they watch the same ops and resizes:
one process, FSDP2 and our ZeRO-3 on 2 gloo ranks, fp32 and bf16. Per category, bytes:

- params, grads and optimizer states are equal to the byte where both count the same
  storages. Where they do not, the difference is a set of storages named here and sized
  from the strategy: our ZeRO's shards, gradient shards and fp32 masters are no module
  parameter, gradient or optimizer state to MemTracker (they are handed to it with
  ``track_external``, so it counts them as "Other"); its gathered ``full`` buffers are
  (the module's parameters are views of them).
- the rest is split differently: ours keeps "activations" for storages autograd holds for
  backward and "other" for everything else, MemTracker files an op's output by when it
  was made (ACT in forward, TEMP in backward) and FSDPMemTracker adds FSDP's own
  (gathered parameters and gradients, collective buffers, inputs). Their sums are equal,
  and what autograd saves is a subset of what forward made or gathered, plus the batch.
- the totals are equal: both trackers are exact ledgers of the same live storages.

Three moments: each tracker's peak (both record after every op, so with equal totals
they peak at the same op), after backward (before the optimizer step), and after the step.
``python tests/test_memtracker_crosscheck.py`` prints the table of docs/zero.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from llm.config import OptimizerConfig, ParallelismConfig
from llm.launch.launcher import free_port
from llm.memory import CATEGORIES, PeakTracker, storage_bytes
from llm.memory.live import STATE
from llm.models import build_model, materialize, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision
from llm.train.trainer import _cross_entropy_sum

CPU = torch.device("cpu")
WORLD, BATCH, SEQ, VOCAB = 2, 2, 32, 257  # per rank: 2 sequences of 32 byte tokens
BUCKET_MB = 0.1  # our ZeRO: a few buckets (about one per block)
PRECISIONS = ("fp32", "bf16")
DISTRIBUTED = [(s, p) for s in ("fsdp", "zero3") for p in PRECISIONS]
MOMENTS = ("peak", "after_backward", "after_step")


def _step(strategy, model, tracker, x, y, tracked: bool, probe) -> None:
    """One step as the Trainer makes it (llm/train/trainer.py: one micro-batch), the peak
    tracker's phases included; ``probe`` reads both trackers once backward is done."""
    with tracker.step(tracked):
        with strategy.micro_batch(sync=True), strategy.loss_context():
            tracker.phase("forward")
            with strategy.precision.autocast(CPU):
                loss = _cross_entropy_sum(model(x), y)
            tracker.phase("backward")
            scaled = loss * (strategy.dims.dp_size / float(WORLD * BATCH * SEQ))
            tracker.watch_backward(scaled)
            strategy.backward(scaled)
        tracker.phase("optimizer_step")
        probe()
        strategy.clip_and_step(1.0)
        strategy.zero_grad()


def _names(snapshot: dict) -> dict[str, int]:
    """MemTracker's snapshot of the CPU by category name (PARAM, ACT, ..., Total)."""
    return {getattr(k, "name", k): v for k, v in snapshot.get(CPU, {}).items()}


def measure(strategy_name: str, precision: str, rank: int = 0, world: int = 1) -> dict:
    """A warm-up step (AdamW's state exists from then on, as in every later step), then one
    step under both trackers: each one's breakdown at the three moments, and the bytes of
    the storages the relations name."""
    torch.manual_seed(0)
    model = materialize(build_model(model_args("gpt2-tiny", vocab_size=VOCAB)), CPU, 0)
    strategy = build_strategy(
        ParallelismConfig(name=strategy_name, bucket_cap_mb=BUCKET_MB),
        ParallelDims.from_config(-1, 1, 1, world, rank),
        resolve_precision(precision, CPU),
        CPU,
    )
    model = strategy.wrap(model)
    strategy.build_optimizer(model, OptimizerConfig(lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    tracker = PeakTracker(CPU, "alternate")
    tracker.watch(strategy.state_tensors)
    _step(strategy, model, tracker, x, y, False, lambda: None)

    buffers = getattr(strategy, "buffers", [])  # our ZeRO's per-bucket tensors
    extra = {
        "batch": storage_bytes([x, y]),
        "shards": storage_bytes([b.shard for b in buffers]),
        "grad_shards": storage_bytes([b.grad_shard for b in buffers]),
        "masters": storage_bytes([b.master for b in buffers if b.master is not b.shard]),
    }
    if strategy_name == "fsdp":
        mt = FSDPMemTracker(model, strategy.optimizer)
        mt.track_inputs((x, y))
    else:
        mt = MemTracker()
        named = [t for b in buffers for t in (b.shard, b.grad_shard, b.master)]
        mt.track_external(model, strategy.optimizer, x, y, *named)
    out = {"extra": extra, "state": strategy.memory(), "torch_tracker": type(mt).__name__}

    def probe() -> None:
        out["after_backward"] = (dict(tracker.totals), _names(mt.get_tracker_snapshot()))

    # MemTracker outermost, built outside our window: it saves UntypedStorage.resize_ when
    # built and restores it on exit, so built or entered inside our window it would bypass
    # our wrapper (llm/memory/live.py wrap_resize) and hide ZeRO-3's and FSDP2's resizes.
    with mt:
        _step(strategy, model, tracker, x, y, True, probe)
    out["peak"] = (tracker.last_step, _names(mt.get_tracker_snapshot("peak")))
    out["after_step"] = (dict(tracker.totals), _names(mt.get_tracker_snapshot()))
    return out


def _ranks(rank: int, world: int, port: int, cases, results) -> None:
    torch.set_num_threads(1)  # two ranks on a shared CPU
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for case in cases:
            results[(*case, rank)] = measure(*case, rank=rank, world=world)
    finally:
        dist.destroy_process_group()


def measure_distributed(cases) -> dict:
    """{(strategy, precision, rank): measure(...)}: every case in one spawn of 2 ranks."""
    results = mp.Manager().dict()
    mp.start_processes(
        _ranks, args=(WORLD, free_port(), cases, results), nprocs=WORLD, start_method="spawn"
    )
    return dict(results)


@pytest.fixture(scope="module")
def distributed() -> dict:
    return measure_distributed(DISTRIBUTED)


# ---- the relations ----------------------------------------------------------------------
def _total(ours: dict) -> int:
    return sum(ours[c] for c in CATEGORIES)


def _late_grads(ours: int, theirs: int, temp: int, moment: str) -> int:
    """Gradient bytes ours counts as grads and MemTracker does not: at the peak, gradients
    made by a backward op that the strategy names as state only later. MemTracker labels
    an op's output when it is made (TEMP in backward) and relabels it in its current
    snapshot once a hook says it is a gradient, but its peak snapshot is a copy taken at
    the peak; ours moves the peak's unlabelled storages that have turned out to be state
    when the phase closes (llm/memory/peak.py ``_finish``). After backward and after the
    step both have labelled them: none."""
    late = ours - theirs
    assert 0 <= late <= temp, (moment, ours, theirs, temp)
    assert late == 0 or moment == "peak", (moment, ours, theirs)
    return late


def check_single(ours: dict, mt: dict, extra: dict, moment: str) -> None:
    """One process: parameters, gradients and AdamW's moments and steps are the same
    storages to both; the batch is handed to MemTracker as "Other"."""
    at = f"single at {moment}"
    assert mt["BUFFER"] == 0, at  # gpt2 has no buffers (nothing either tracker could miss)
    assert ours["params"] == mt["PARAM"] > 0, at
    late = _late_grads(ours["grads"], mt["GRAD"], mt["TEMP"], moment)
    assert ours["optimizer_states"] == mt["OPT"] > 0, at
    assert mt["OTH"] == extra["batch"], at
    # Not state: saved or not (ours), made in forward or backward (MemTracker).
    not_state = mt["ACT"] + mt["TEMP"] + mt["OTH"]
    assert ours["activations"] + ours["other"] + late == not_state, at
    # What autograd holds was made in forward, or is the batch (the embedding saves it).
    assert ours["activations"] <= mt["ACT"] + mt["OTH"], at
    assert _total(ours) == mt["Total"], at


def check_fsdp(ours: dict, mt: dict, extra: dict, moment: str) -> None:
    """FSDP2: the sharded parameters and gradients and the optimizer states are the same
    storages to both; the gathered parameters and unreduced gradients, the all-gather and
    reduce-scatter buffers and the batch are FSDPMemTracker's categories of their own, and
    not state to ours (activations where autograd saved them, else other)."""
    at = f"fsdp at {moment}"
    assert ours["params"] == mt["SHARDED_PARAM"] > 0, at
    late = _late_grads(ours["grads"], mt["SHARDED_GRAD"], mt["TEMP"], moment)
    assert ours["optimizer_states"] == mt["OPT"] > 0, at
    assert mt["INP"] == extra["batch"], at
    fsdp_own = ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER", "BUFFER")
    not_state = mt["ACT"] + mt["TEMP"] + mt["INP"] + sum(mt[k] for k in fsdp_own)
    assert ours["activations"] + ours["other"] + late == not_state, at
    # Saved: made in forward, a gathered weight (a matmul saves it), or the batch.
    assert ours["activations"] <= mt["ACT"] + mt["UNSHARDED_PARAM"] + mt["INP"], at
    assert _total(ours) == mt["Total"], at


def check_zero3(ours: dict, mt: dict, extra: dict, moment: str) -> None:
    """Our ZeRO-3: MemTracker's PARAM is the gathered ``full`` buffers (the parameters are
    views of them), its OPT AdamW's moments and steps; the shards, gradient shards and fp32
    masters (bf16) are no parameter, gradient or optimizer state to it, so they are handed
    over as "Other". The gradient buckets are backward outputs, TEMP to it. Its GRAD is
    only a parameter's fresh gradient, which its tensor hook labels and our
    post-accumulate hook (registered first) then copies into the bucket, setting
    ``param.grad`` to None before MemTracker's own post-accumulate hook reads it."""
    at = f"zero3 at {moment}"
    named = extra["shards"] + extra["grad_shards"] + extra["masters"]
    assert mt["OTH"] == extra["batch"] + named, at
    assert ours["params"] == mt["PARAM"] + extra["shards"], at
    assert ours["optimizer_states"] == mt["OPT"] + extra["masters"], at
    # Full-size gradient buckets and reduce-scatter outputs: made in backward, all retired
    # by its end (stage 3 keeps only the shard).
    buckets = _late_grads(ours["grads"], extra["grad_shards"], mt["TEMP"], moment)
    # A parameter's fresh gradient between autograd's hook and our bucket copy: GRAD to
    # MemTracker (its tensor hook labels it), "other" to ours, never alive after backward.
    assert mt["GRAD"] == 0 or moment == "peak", at
    not_state = mt["ACT"] + mt["TEMP"] + mt["GRAD"] + extra["batch"]
    assert ours["activations"] + ours["other"] + buckets == not_state, at
    assert ours["activations"] <= mt["ACT"] + extra["batch"], at
    assert _total(ours) == mt["Total"], at


CHECKS = {"single": check_single, "fsdp": check_fsdp, "zero3": check_zero3}


def check(strategy: str, measured: dict) -> None:
    # Not vacuous: after backward every category of ours holds something.
    assert all(measured["after_backward"][0][c] > 0 for c in STATE), measured["after_backward"]
    for moment in MOMENTS:
        ours, mt = measured[moment]
        CHECKS[strategy](ours, mt, measured["extra"], moment)
    # After the step the tracker holds the strategy's state, as memory() counts it.
    after, _ = measured["after_step"]
    assert {k: after[k] for k in measured["state"]} == measured["state"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_process_matches_memtracker(precision):
    check("single", measure("single", precision))


@pytest.mark.parametrize(("strategy", "precision"), DISTRIBUTED)
@pytest.mark.slow
def test_two_ranks_match_memtracker(distributed, strategy, precision):
    for rank in range(WORLD):
        check(strategy, distributed[(strategy, precision, rank)])


# ---- the table in docs/zero.md -------------------------------------------------------------
# MemTracker's categories under the column of ours they fall in (OTH split by what it holds).
PLACED = {
    "single": [("PARAM",), ("GRAD",), ("OPT",), ("ACT",), ("TEMP", "OTH")],
    "fsdp": [
        ("SHARDED_PARAM",),
        ("SHARDED_GRAD",),
        ("OPT",),
        ("ACT", "UNSHARDED_PARAM"),
        ("TEMP", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER", "INP", "BUFFER"),
    ],
    "zero3": [
        ("PARAM", "OTH shards"),
        ("OTH grad_shards",),
        ("OPT", "OTH masters"),
        ("ACT",),
        ("TEMP", "GRAD", "OTH batch"),
    ],
}


def _cell(mt: dict, extra: dict, keys: tuple[str, ...]) -> str:
    parts = []
    for key in keys:
        value = extra[key.split()[1]] if key.startswith("OTH ") else mt[key]
        if value or len(keys) == 1:
            parts.append(f"{key.replace('_', ' ')} {value:,}")
    return " + ".join(parts) or "0"


def print_table() -> None:
    """docs/zero.md's rows: rank 0's peak, ours then MemTracker's, in markdown."""
    runs = {("single", p, 0): measure("single", p) for p in PRECISIONS}
    runs |= measure_distributed(DISTRIBUTED)
    for strategy in CHECKS:
        for precision in PRECISIONS:
            measured = runs[(strategy, precision, 0)]
            ours, mt = measured["peak"]
            mine = " | ".join(f"{ours[c]:,}" for c in CATEGORIES)
            theirs = " | ".join(_cell(mt, measured["extra"], k) for k in PLACED[strategy])
            run, torch_name = f"{strategy} {precision}", measured["torch_tracker"]
            print(f"| {run} | ours ({ours['phase']}) | {mine} | {_total(ours):,} |")
            print(f"| {run} | {torch_name} | {theirs} | {mt['Total']:,} |")


if __name__ == "__main__":
    print_table()
