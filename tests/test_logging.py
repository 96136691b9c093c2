"""The run logger: the rank-0 progress bar, metrics.jsonl records and summary.json."""

from __future__ import annotations

import io
import json

from rich.console import Console

from llm.config import LoggerConfig
from llm.logging import RunLogger


def make_logger(tmp_path, terminal: bool):
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=terminal, width=160)
    logger = RunLogger(
        LoggerConfig(name="none"),
        tmp_path,
        {},
        max_steps=10,
        run_name="t",
        group=None,
        console=console,
    )
    return logger, stream


def test_progress_bar_shows_loss_throughput_and_time_left(tmp_path):
    logger, stream = make_logger(tmp_path, terminal=True)
    logger.advance(5, loss=2.5, tokens_per_sec=12345.0)
    logger.close()
    out = stream.getvalue()
    assert "step 5/10" in out and "loss 2.5000" in out and "12,345 tok/s" in out
    assert "left" in out


def test_metrics_records_are_json_with_nan_as_null(tmp_path):
    logger, stream = make_logger(tmp_path, terminal=False)
    logger.log(3, {"loss": float("nan"), "lr": 1e-3})
    logger.summary({"steps": 3, "final_val_loss": float("inf")})
    logger.close()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 3 and record["loss"] is None and record["lr"] == 1e-3
    assert "step      3/10  loss nan  lr 0.001" in stream.getvalue()  # the console line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"steps": 3, "final_val_loss": None}
