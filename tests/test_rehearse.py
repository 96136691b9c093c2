"""``python -m llm.rehearse``: one rank of an N-rank run in one process over torch's fake
process group, checked against real gloo runs of the same layout (rank 0's tracked peak:
model states exactly, the total within 2%; every collective's bytes exactly where routing
does not decide them) and against the estimator (states exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_config, one_line, run, small_run_overrides

from llm.build import model_args_for
from llm.errors import ConfigError
from llm.estimate.estimator import estimate
from llm.rehearse.rank import rehearsal_config, rehearse

STATES = ("params", "grads", "optimizer_states")
# What the rehearsal sets itself, given to the real runs it is compared with.
AS_REHEARSED = (
    "train.max_steps=4",
    "train.memory_tracking=alternate",
    "train.eval_every=5",
    "parallelism.count_comm=true",
    "checkpoint.enabled=false",
)


def _rehearse(out: Path, corpus: Path, cache: Path, world: int, *extra: str, rank: int = 0):
    overrides = small_run_overrides(out, corpus, cache, *extra)
    cfg = compose_config([*overrides, f"rehearse.world_size={world}", f"rehearse.rank={rank}"])
    return rehearse(cfg)


def _rehearse_command(out: Path, corpus: Path, cache: Path, world: int, rank: int, *extra: str):
    """``python -m llm.rehearse`` in a process of its own (one rehearsal per process: torch's
    DTensor caches key on meshes, which compare equal across ranks); its rehearse.json."""
    overrides = [
        o for o in small_run_overrides(out, corpus, cache, *extra) if "output_dir" not in o
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llm.rehearse",
            *overrides,
            f"rehearse.world_size={world}",
            f"rehearse.rank={rank}",
            f"hydra.run.dir={out}",
        ],
        capture_output=True,
        text=True,
        cwd=out.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rank {rank} of {world}" in result.stdout
    return json.loads((out / "rehearse.json").read_text())


def _estimated_states(world: int, rank: int, *extra: str) -> dict:
    unused = Path("unused")
    cfg = compose_config(
        [
            *small_run_overrides(unused, unused, unused, *extra),
            f"launcher.nproc_per_node={world}",
            "estimate.device=cpu",
            f"estimate.rank={rank}",
        ]
    )
    est = estimate(cfg, model_args_for(cfg, vocab_size=257))  # the byte tokenizer's
    return {k: est.device[k] for k in STATES}


@pytest.mark.parametrize(
    "extra, why",
    [
        (["parallelism=deepspeed"], "deepspeed.comm"),
        (["layout=tp2_pp2", "parallelism.sequence_parallel=true"], "a tp rank's share"),
        (["checkpoint.resume=/tmp"], "starts from initial weights"),
    ],
)
def test_what_cannot_be_rehearsed_is_refused_in_one_line(extra, why):
    unused = Path("unused")
    cfg = compose_config(
        [*small_run_overrides(unused, unused, unused, *extra), "rehearse.world_size=4"]
    )
    with pytest.raises(ConfigError) as exc:
        rehearsal_config(cfg)
    assert why in one_line(exc)


def test_a_rank_outside_the_world_and_a_missing_world_size_are_refused():
    unused = Path("unused")
    with pytest.raises(ConfigError, match=r"rehearse\.rank=4 is not a rank"):
        compose_config(
            [
                *small_run_overrides(unused, unused, unused),
                "rehearse.world_size=4",
                "rehearse.rank=4",
            ]
        )
    cfg = compose_config(small_run_overrides(unused, unused, unused))
    with pytest.raises(ConfigError, match=r"rehearse\.world_size is not set"):
        rehearsal_config(cfg)


def test_the_estimator_equals_the_rehearsal_for_model_states(tmp_path, text_corpus, cache_dir):
    """A rank of a world no real run here reaches: the estimator's params, grads and
    optimizer states for rank 5 of 8 under zero2 equal what the rehearsed rank's strategy
    holds (our ZeRO's padded buckets: ranks differ by a few elements)."""
    summary = _rehearse(tmp_path, text_corpus, cache_dir, 8, "parallelism=zero2", rank=5)
    assert _estimated_states(8, 5, "parallelism=zero2") == summary["model_state_bytes"][0]


LAYOUTS = {
    "ddp_x2": (2, ["parallelism=ddp"]),
    "zero3_x2": (2, ["parallelism=zero3"]),
    "zero1_x4": (4, ["parallelism=zero1"]),
    "fsdp_tp2_x4": (4, ["parallelism=fsdp", "parallelism.tp_size=2"]),
    "hsdp_x4": (4, ["parallelism=fsdp", "parallelism.replicate=2"]),
    "ddp_ep4_x4": (4, ["layout=ddp_dp4_ep4", "model=moe-tiny"]),
    "pp2_x2": (2, ["parallelism.pp_size=2"]),
    "fsdp_pp2_x4": (4, ["layout=fsdp_dp2_pp2"]),
    "tp2_pp2_x4": (4, ["layout=tp2_pp2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_0_rehearsed_equals_the_real_run(tmp_path, text_corpus, cache_dir, name):
    """The real N-rank gloo run and the rehearsal of its rank 0 (and of its last rank, under
    pp a later stage, whose neighbours' shapes the rehearsal answers for) at the same layout
    and steps: the tracked step peak's model states and the strategy's
    state bytes exactly, the peak's total within 2% (not under ep), and the bytes of every
    collective exactly, except the MoE exchange's: under ep both follow where every rank's
    tokens routed."""
    world, extra = LAYOUTS[name]
    real, _ = run(
        tmp_path,
        "real",
        text_corpus,
        cache_dir,
        f"launcher.nproc_per_node={world}",
        *AS_REHEARSED,
        *extra,
    )
    rehearsed = _rehearse(tmp_path / "rehearsed", text_corpus, cache_dir, world, *extra)
    peak, measured = rehearsed["memory_peak"][0], real["memory_peak"][0]
    assert {k: peak[k] for k in STATES} == {k: measured[k] for k in STATES}
    assert rehearsed["model_state_bytes"][0] == real["model_state_bytes"][0]
    if "layout=ddp_dp4_ep4" not in extra:
        # Under ep the experts' rows are where every rank's tokens routed, which a rehearsal
        # cannot know: it receives as many rows as it sends (measured: -12% of the total).
        assert peak["total"] == pytest.approx(measured["total"], rel=0.02)
    comm, real_comm = rehearsed["comm_bytes_per_step"][0], real["comm_bytes_per_step"][0]
    routed = {"all_to_all"}
    assert {k: v for k, v in comm.items() if k not in routed} == {
        k: v for k, v in real_comm.items() if k not in routed
    }
    last = _rehearse_command(tmp_path / "last", text_corpus, cache_dir, world, world - 1, *extra)
    assert last["model_state_bytes"] == real["model_state_bytes"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("world, strategy", [(16, "fsdp"), (64, "zero3")])
def test_the_estimator_equals_a_rehearsed_gpt2_large_rank(
    tmp_path, text_corpus, cache_dir, world, strategy
):
    """gpt2-large (774M, fp32) on 16 and 64 rehearsed ranks, sizes no real run here reaches,
    rank 0 (three steps: the third is the first probe after the optimizer made its state).
    The estimator's model states equal the rehearsal's exactly, its activations (with the
    gathered weights autograd saves) are within 3% of the most the tracker saw in a step,
    and its total (the larger of its end-of-forward and backward moments,
    llm.estimate.backward_peak) is within 3% of the rehearsed peak, which falls in backward
    (docs/parallel.md, "gpt2-large on 16 and 64 rehearsed ranks")."""
    extra = (
        "model=gpt2-large",
        f"parallelism={strategy}",
        "train.micro_batch_size=1",
        "data.seq_len=128",
        "rehearse.steps=3",
    )
    summary = _rehearse(tmp_path, text_corpus, cache_dir, world, *extra)
    unused = Path("unused")
    cfg = compose_config(
        [
            *small_run_overrides(unused, unused, unused, *extra),
            f"launcher.nproc_per_node={world}",
            "estimate.device=cpu",
        ]
    )
    est = estimate(cfg, model_args_for(cfg, vocab_size=257))
    peak = summary["memory_peak"][0]
    assert {k: est.device[k] for k in STATES} == summary["model_state_bytes"][0]
    saved = est.device["activations"] + est.device.get("gathered_weights", 0)
    assert saved == pytest.approx(peak["activations_max"], rel=0.03)
    assert peak["phase"] == "backward"
    assert est.peak_rows is est.backward
    assert est.total == pytest.approx(peak["total"], rel=0.03)


@pytest.mark.slow
def test_the_command_writes_a_rank_the_estimator_agrees_with(tmp_path, text_corpus, cache_dir):
    """``python -m llm.rehearse`` for rank 3 of 8 under fsdp x tp 2: its table and JSON, the
    peak's categories adding up to its total, a step time and the collectives' bytes, and
    the estimator's model states for that rank exactly."""
    extra = ("parallelism=fsdp", "parallelism.tp_size=2")
    figures = _rehearse_command(tmp_path / "run", text_corpus, cache_dir, 8, 3, *extra)
    assert figures["layout"]["dp_size"] == 4 and figures["layout"]["tp_size"] == 2
    peak = figures["memory_peak"]
    assert peak["total"] == sum(peak[k] for k in (*STATES, "activations", "other"))
    assert figures["step_time_s"] > 0 and figures["comm_bytes_per_step"]["tp.all_reduce"] > 0
    assert _estimated_states(8, 3, *extra) == figures["model_state_bytes"]
