"""The calibrated time model against Megatron-LM's Table 1 and BLOOM-176B
(llm.estimate.published_runs; docs/parallel.md, "Checked against Megatron-LM's Table 1"):
the paper's FLOP count, the published figures against the paper, the generated table
against the copy in the docs, and a reason for every row that misses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm.estimate.published_runs import (
    BLOOM,
    REASONS,
    TABLE1,
    TREND_REASON,
    equation3_flops,
    predict,
    report,
    trend_holds,
)

PARALLEL_MD = Path(__file__).resolve().parents[1] / "docs" / "parallel.md"

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", SC21, arXiv:2104.04473, Table 1 (docs/references.md): parameters
# (billions), attention heads, hidden size, layers, tensor- and pipeline-parallel size,
# GPUs, batch size, achieved TFLOP/s per GPU, % of theoretical peak, aggregate PFLOP/s.
PAPER_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]


@pytest.fixture(scope="module")
def predictions():
    return [predict(run) for run in TABLE1], predict(BLOOM)


@pytest.fixture(scope="module")
def generated(predictions):
    return report(*predictions)


def test_equation3_on_the_1t_row_by_hand():
    """B 3072, s 2048, l 128, h 25600, V 51200: 96·B·s·l·h² = 5.0665495807918080e19, times
    1 + 2048/153600 + 51200/52428800 = 1.01431..., is 5.1390513775e19 FLOPs per iteration,
    102.4 s at the paper's 502 PFLOP/s."""
    assert 96 * 3072 * 2048 * 128 * 25600**2 == 50_665_495_807_918_080_000
    flops = equation3_flops(batch=3072, seq=2048, layers=128, hidden=25600, vocab=51200)
    assert flops == pytest.approx(5.1390513775e19, rel=1e-10)
    assert flops / 502e15 == pytest.approx(102.37, abs=0.01)


def test_the_held_figures_are_the_papers():
    """Every run the module holds is the paper's row: shape, layout, GPUs, batch and the
    per-GPU figure; the per-GPU figure agrees with the paper's % of peak and aggregate."""
    assert len(TABLE1) == len(PAPER_TABLE1)
    for run, row in zip(TABLE1, PAPER_TABLE1, strict=True):
        params, heads, hidden, layers, tp, pp, gpus, batch, tflops, peak, aggregate = row
        assert run.name == f"{params:.1f}B"
        assert (run.heads, run.hidden, run.layers) == (heads, hidden, layers)
        assert (run.tp, run.pp, run.gpus, run.batch, run.tflops) == (
            tp, pp, gpus, batch, tflops,
        )  # fmt: skip
        assert (run.vocab, run.dp * tp * pp) == (51200, gpus)
        assert round(100 * tflops / 312) == peak
        # The aggregate is rounded to 0.1 PFLOP/s, the per-GPU figure to 1 TFLOP/s.
        assert abs(aggregate * 1000 / gpus - tflops) <= 0.5 + 50 / gpus


def test_the_generated_table_prints_the_papers_figures(generated):
    """Each generated row shows its run's published layout, GPUs and per-GPU figure as the
    paper prints them."""
    rows = [line for line in generated.splitlines() if re.match(r"\| [\d.]+B \|", line)]
    assert len(rows) == len(PAPER_TABLE1)
    for line, row in zip(rows, PAPER_TABLE1, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        params, _, _, _, tp, pp, gpus, _, tflops, peak, _ = row
        assert cells[0] == f"{params:.1f}B"
        assert cells[1].startswith(f"{tp} x {pp} x {gpus // (tp * pp)},")
        assert cells[2] == f"{gpus:,}"
        assert cells[3] == f"{tflops} ({peak}%)"


def test_the_docs_hold_the_generated_table(generated):
    """docs/parallel.md's copy is the module's output, verbatim."""
    text = PARALLEL_MD.read_text()
    block = re.search(r"<!-- published-runs -->\n(.*)\n<!-- /published-runs -->", text, re.S)
    assert block is not None, "docs/parallel.md lost its published-runs block"
    assert block.group(1) == generated, "regenerate: python -m llm.estimate.published_runs"


def test_the_predicted_figure_uses_equation3(predictions):
    table1, bloom = predictions
    for p in (*table1, bloom):
        r = p.run
        flops = equation3_flops(r.batch, 2048, r.layers, r.hidden, r.vocab)
        assert p.tflops == pytest.approx(flops / p.estimate.step_time_s / r.gpus / 1e12)
        assert p.estimate.layout.recompute == "full"


def test_every_miss_names_its_reason(predictions, generated):
    """A row more than 15% off is marked with the letter of a reason the docs print."""
    table1, bloom = predictions
    for p in (*table1, bloom):
        if p.miss is None:
            continue
        assert p.miss in REASONS, f"{p.run.name} misses {p.miss}ward with no reason"
        row = next(line for line in generated.splitlines() if line.startswith(f"| {p.run.name} "))
        assert f"no {REASONS[p.miss][:3]}" in row
        assert REASONS[p.miss] in generated


def test_the_trend_or_its_reason(predictions, generated):
    """The predictions follow the paper's order from 1.7B to 1T wherever two published
    figures differ by more than 15%; where they do not, the docs say why."""
    table1, _ = predictions
    if trend_holds(table1):
        assert "Trend from 1.7B to 1T followed: yes." in generated
    else:
        assert f"Trend from 1.7B to 1T followed: no. {TREND_REASON}." in generated
