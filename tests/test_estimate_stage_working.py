"""What a pipeline rank holds beside its saved tensors and stage outputs
(llm.estimate.stages ``receive_buffers`` and ``stage_working``): torch's per-micro-batch
receive buffers, counted from the layout, and the first stage's total against one rehearsed
rank (the real stage over torch's fake process group, its live tensors tracked)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose_config, small_run_overrides

from llm.build import model_args_for
from llm.estimate.estimator import estimate
from llm.rehearse.rank import rehearse

UNUSED = Path("unused")


def _estimate(world: int, rank: int, *extra: str):
    overrides = small_run_overrides(UNUSED, UNUSED, UNUSED, *extra)
    cfg = compose_config(
        [*overrides, f"launcher.nproc_per_node={world}", "estimate.device=cpu",
         f"estimate.rank={rank}"]
    )  # fmt: skip
    return estimate(cfg, model_args_for(cfg, vocab_size=257))


@pytest.mark.parametrize(
    "schedule, stages_receiving",
    [
        # 4 stages on 4 ranks: rank 1 receives activations and gradients
        ("1f1b", 2),
        # zbv: rank 1 runs stages 1 and 6 of 8, each with two neighbours on other ranks;
        # rank 0 stages 0 and 7, one each
        ("zbv_zero_bubble", 4),
    ],
)
def test_receive_buffers_are_one_per_micro_batch_and_neighbour_on_another_rank(
    schedule, stages_receiving
):
    """gpt2-tiny, fp32, 4 micro-batches of one 64-token sequence: each buffer is the
    residual stream, (1, 64, 64) in fp32; the last rank of a V-shaped schedule, whose two
    stages meet on it, holds none for that turn."""
    extra = ("model.n_layers=8", "parallelism.pp_size=4", f"parallelism.pp_schedule={schedule}",
             "parallelism.pp_microbatches=4", "precision=fp32",
             f"parallelism.pp_virtual_stages={2 if schedule == 'zbv_zero_bubble' else 1}")  # fmt: skip
    est = _estimate(4, 1, *extra)
    stream = 64 * 64 * 4
    rows = {s.pp_rank: s.device for s in est.stages}
    assert rows[1]["receive_buffers"] == stages_receiving * 4 * stream
    assert rows[0]["receive_buffers"] == (1 if schedule == "1f1b" else 2) * 4 * stream
    if schedule == "zbv_zero_bubble":  # stages 3 and 4: one neighbour each elsewhere
        assert rows[3]["receive_buffers"] == 2 * 4 * stream


@pytest.mark.parametrize("tp", [1, 2])
def test_the_first_stage_holds_its_working_set_as_rehearsed(tmp_path, text_corpus, cache_dir, tp):
    """gpt2-tiny over pp 2 (and tp 2), ZeRO-1 over dp 2, 1f1b with 2 micro-batches: the
    first stage's total, with its receive buffers and its working set, within 1% of its
    tracked peak; without those rows it is further off."""
    extra = ("parallelism=zero1", "parallelism.pp_size=2", "parallelism.dp_size=2",
             f"parallelism.tp_size={tp}", "parallelism.pp_microbatches=2",
             "precision=fp32")  # fmt: skip
    world = 4 * tp
    overrides = small_run_overrides(tmp_path, text_corpus, cache_dir, *extra)
    summary = rehearse(compose_config([*overrides, f"rehearse.world_size={world}"]))
    peak = summary["memory_peak"][0]["total"]
    rows = next(s for s in _estimate(world, 0, *extra).stages if s.pp_rank == 0).device
    assert rows["receive_buffers"] > 0 and rows["stage_working"] > 0
    assert sum(rows.values()) == pytest.approx(peak, rel=0.01)
    before = sum(rows.values()) - rows["receive_buffers"] - rows["stage_working"]
    assert abs(before - peak) > abs(sum(rows.values()) - peak)
