"""Data parallel over each pipeline stage's dp group (dp=2 x pp=2, 4 gloo ranks): our ZeRO
stages and ddp against one process, fp32, same seed and data.

Every run has the reference's global batch of 8 sequences of 64 byte tokens: each dp rank
reads 4, split into pipeline micro-batches of 2 (pp_microbatches=2). Only the order of
additions differs from one process (micro-batch gradients accumulated or reduced one by
one, the dp reduction, the tied embedding's two halves meeting in an all-reduce), hence the
pipeline tests' tolerance (``helpers.assert_run_matches``): 1e-5 relative on losses and
clipping norms, 1e-4 relative + 1e-5 absolute on final weights.
"""

from __future__ import annotations

import json

import pytest
from helpers import assert_run_matches, read_metrics, reference_runs, run

from llm.models import model_args, num_params

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    return reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS)


def dp_pp_run(tmp_path, text_corpus, cache_dir, strategy, *extra, nproc=4, name="dp_pp"):
    """gpt2-tiny (tied embedding split over the stages) under ``strategy`` on dp x pp=2,
    small buckets (several per stage, pieces cut mid-parameter)."""
    return run(
        tmp_path,
        name,
        text_corpus,
        cache_dir,
        f"parallelism={strategy}",
        f"launcher.nproc_per_node={nproc}",
        "parallelism.pp_size=2",
        "parallelism.bucket_cap_mb=0.05",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
        *extra,
    )


def test_zero2_data_parallel_pipeline_matches_single_process(
    tmp_path, reference, text_corpus, cache_dir
):
    """zero2 reduce-scatters each micro-batch's gradients over the stage's dp group; the
    tied embedding's copies (their own bucket, split alike at both ends) add their shards.
    Each rank holds its stage's parameters whole (working copy) and a half of its stage's
    gradients and AdamW states: fp32, 4 + 4/2 + 8/2 bytes per parameter of the stage."""
    summary, out = dp_pp_run(tmp_path, text_corpus, cache_dir, "zero2", "parallelism.pp_schedule=1f1b")
    assert (summary["dp_size"], summary["pp_size"]) == (2, 2)
    assert_run_matches(reference("gpt2-tiny"), out, STEPS)
    memory = read_metrics(out)[-1]
    print(json.dumps(memory, indent=1)[:3000])
