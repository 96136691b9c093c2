"""The training loop holds tensor collectives only (issue 41, items 3 and 6): a real small
run on 2 gloo ranks per strategy, every collective of each step counted inside the ranks
(tests/collective_count_ranks.py), named by its op and the llm/ file that issued it.

- no object collective (pickled, and under NCCL a host-device round trip) in any step,
  logged or not: every rank's peaks travel in the logged step's one all-reduce. One
  exception, in the first step only: torch's pipeline stages send their inferred shapes
  as objects there (pp);
- every step of a kind issues the same collectives, after the first two (DDP rebuilds its
  buckets at the second forward, FSDP2 initialises lazily in the first);
- a logged step adds exactly one all-reduce to a step that is not logged, from the Trainer;
- DDP issues no gradient-norm all-reduce (its gradients are equal on every rank already);
  the sharding strategies do, once a step.

Checkpoints are off: a save exchanges objects (DCP's planner and our checks gather them),
which the issue leaves to the save steps.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from collective_count_ranks import counted_main
from helpers import compose_config, small_run_overrides

from llm.data import prepare_data
from llm.launch.launcher import _spawn, prepare_for_ranks

pytestmark = pytest.mark.slow

STEPS = 9
LOG_EVERY = 3  # logged: 1, 3, 6 (9 is the last, not counted); probes: 1, 3, 6
LOGGED, NOT_LOGGED = (3, 6), (4, 5, 7, 8)
TWO = ("launcher.nproc_per_node=2", "train.micro_batch_size=2")
MOE = ("model=moe-tiny", "model.moe.kernel=grouped")
NORM = "llm/parallel/step.py"
TRAINER = "llm/train/trainer.py"

SHAPE_INFERENCE = {
    f"object:{kind}_object_list @ llm/parallel/pipeline/schedule.py" for kind in ("send", "recv")
}

STRATEGIES = {
    "ddp": ("parallelism=ddp",),
    "zero1": ("parallelism=zero1",),
    "zero2": ("parallelism=zero2",),
    "zero3": ("parallelism=zero3",),
    "fsdp": ("parallelism=fsdp",),
    "tp": ("parallelism=single", "parallelism.tp_size=2"),
    "pp": ("parallelism=single", "parallelism.pp_size=2"),
    "ep": ("parallelism=ddp", "parallelism.ep_size=2", *MOE),
}


def _counts(tmp_path, text_corpus, cache_dir, extra) -> list[dict[int, Counter]]:
    """Per rank: step -> Counter of "op @ file"."""
    out = tmp_path / "run"
    overrides = small_run_overrides(out, text_corpus, cache_dir, *extra, *TWO)
    cfg = prepare_for_ranks(
        compose_config(
            [
                *overrides,
                f"train.max_steps={STEPS}",
                f"train.log_every={LOG_EVERY}",
                "checkpoint.enabled=false",
            ]
        )
    )
    prepare_data(cfg.data)
    _spawn(cfg, 2, counted_main)
    ranks = []
    for rank in range(2):
        steps = json.loads((out / f"collectives_rank{rank}.json").read_text())
        ranks.append({int(step): Counter(c) for step, c in steps.items()})
    return ranks


def _of(counts: Counter, where: str) -> int:
    return sum(n for key, n in counts.items() if key.endswith(f"@ {where}"))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_loop_holds_tensor_collectives_only(tmp_path, text_corpus, cache_dir, name, capsys):
    ranks = _counts(tmp_path, text_corpus, cache_dir, STRATEGIES[name])
    for rank, steps in enumerate(ranks):
        assert sorted(steps) == list(range(1, STEPS)), steps
        objects = {s: {k for k in c if k.startswith("object:")} for s, c in steps.items()}
        # torch's pipeline stages infer their shapes in the schedule's first step, sending
        # them as objects (start-up work, though it runs inside step 1).
        first = SHAPE_INFERENCE if name == "pp" else set()
        assert objects.pop(1) <= first and not any(objects.values()), (rank, objects)
        for kind in (LOGGED, NOT_LOGGED):
            first = steps[kind[0]]
            for step in kind[1:]:
                assert steps[step] == first, (rank, kind[0], step, first, steps[step])
        logged, quiet = steps[LOGGED[0]], steps[NOT_LOGGED[0]]
        added = logged - quiet
        assert added == Counter({f"allreduce_ @ {TRAINER}": 1}), (rank, added)
        assert not quiet - logged, (rank, quiet - logged)
        # DDP's gradients are equal on every rank; its expert slices (ep) are not.
        assert _of(quiet, NORM) == (0 if name == "ddp" else 1), (rank, quiet)
    with capsys.disabled():
        quiet, logged = ranks[0][NOT_LOGGED[0]], ranks[0][LOGGED[0]]
        print(
            f"\n{name}: {sum(quiet.values())} collectives per step, {sum(logged.values())} logged"
        )
        for key, n in sorted(quiet.items()):
            print(f"  {n:3d}  {key}")
