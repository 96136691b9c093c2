"""benchmarks/pipeline.py on a tiny shape (2 ranks): the quantities that do not depend on
timing equal the estimator's exactly: stage micro-batches in flight (GPipe m, 1F1B
min(m, p - stage), torch's action orders for the multi-stage schedules, counted by
wrapping the stages' chunks as they run) and bytes sent per step across stage boundaries
(one (b, s, h) fp32 tensor per micro-batch each way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pipeline as bench


@pytest.mark.slow
def test_pipeline_benchmark_counts_equal_the_formulas():
    argv = "--microbatches 4,8 --d-model 64 --layers 4 --seq-len 32 --batch 8 --steps 1"
    schedules = "gpipe,1f1b,interleaved_1f1b,interleaved_zero_bubble,zbv_zero_bubble"
    opts = bench.parse([*argv.split(), "--warmup", "1", "--schedules", schedules])
    results = bench.measure(opts)
    assert len(results) == 10  # 5 schedules x 2 micro-batch counts
    for rows in results:
        assert [r["rank"] for r in rows] == [0, 1]
        for row in rows:
            formula = bench.expected(row, opts.pp, opts.seq_len, opts.d_model)
            assert row["in_flight"] == formula["in_flight"], row
            assert row["sent"] == formula["sent"], row
            assert row["activations"] > 0 and min(row["per_microbatch"]) > 0
