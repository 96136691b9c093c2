"""benchmarks/pipeline.py on a tiny shape (2 ranks): the quantities that do not depend on
timing equal the formulas exactly: micro-batches in flight (GPipe m, 1F1B min(m, p - stage))
and bytes sent per step across the stage boundary (one (b, s, h) fp32 tensor per
micro-batch each way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pipeline as bench


@pytest.mark.slow
def test_pipeline_benchmark_counts_equal_the_formulas():
    argv = "--microbatches 2,4 --d-model 64 --layers 2 --seq-len 32 --batch 8 --steps 1"
    opts = bench.parse([*argv.split(), "--warmup", "1"])
    results = bench.measure(opts)
    assert len(results) == 4  # 2 schedules x 2 micro-batch counts
    for rows in results:
        assert [r["stage"] for r in rows] == [0, 1]
        for row in rows:
            formula = bench.expected(row, opts.pp, opts.seq_len, opts.d_model)
            assert row["in_flight"] == formula["in_flight"], row
            assert row["sent"] == formula["sent"], row
            assert row["activations"] > 0 and row["per_microbatch"] > 0
