"""Checkpoints of sharded strategies are written and read without a gather: during save and
load the peak tracker's temporaries ("other") stay within one bucket in fp32, far below the
whole fp32 weights and moments (12Φ bytes) that all-gathering checkpoints make on every rank."""

from __future__ import annotations

import math

import pytest
import torch.distributed.checkpoint as dcp
from helpers import run, train_losses

SLACK = 256 * 1024  # DCP's plans and metadata, RNG states, pickled objects


def _largest_param(ckpt) -> int:
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return max(
        math.prod(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")
    )


def _save_then_resume(tmp_path, text_corpus, cache_dir, nproc, *extra):
    """Train 2 steps and save; resume from that checkpoint for a third step. Returns both
    summaries and the checkpoint."""
    common = (f"launcher.nproc_per_node={nproc}", "train.log_every=1", *extra)
    saved, out = run(tmp_path, "saved", text_corpus, cache_dir, *common, "train.max_steps=2")
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    resumed, again = run(
        tmp_path,
        "resumed",
        text_corpus,
        cache_dir,
        *common,
        "train.max_steps=3",
        f"checkpoint.resume={ckpt}",
    )
    assert sorted(train_losses(again)) == [3]
    return saved, resumed, ckpt


def _assert_no_gather(saved, resumed, ckpt, bucket_mb: float, working_bytes: int) -> None:
    # One bucket in fp32: a master (or moment) shard of the bucket, which a parameter larger
    # than the bucket size fills alone.
    bucket = 4 * max(int(bucket_mb * 2**20 / working_bytes), _largest_param(ckpt))
    gather = 12 * saved["n_params"]  # what the all-gathering save made per rank
    for summary, phase in ((saved, "checkpoint_save"), (resumed, "checkpoint_load")):
        for rank, by_phase in enumerate(summary["memory_peak_by_phase"]):
            other = by_phase[phase]["other"]
            assert other <= bucket + SLACK, (phase, rank, other, bucket)
            assert other < gather / 4, (phase, rank, other, gather)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_saves_and_loads_within_one_bucket(tmp_path, text_corpus, cache_dir, stage):
    bucket_mb = 0.05
    saved, resumed, ckpt = _save_then_resume(
        tmp_path,
        text_corpus,
        cache_dir,
        2,
        f"parallelism=zero{stage}",
        f"parallelism.bucket_cap_mb={bucket_mb}",
        "precision=bf16",
        "train.micro_batch_size=2",
    )
    _assert_no_gather(saved, resumed, ckpt, bucket_mb, working_bytes=2)
