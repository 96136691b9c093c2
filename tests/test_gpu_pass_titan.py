"""The speed section's torchtitan row (benchmarks/gpu_pass/titan.py): our shape in
torchtitan's terms, its command line, its metrics read back, and the row where it cannot run.
The metrics sample is torchtitan 0.2.2's own, from a 4-step run on an H200 (batch 2 x 32)."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_pass import titan

SAMPLE = Path(__file__).parent / "gpu_pass_fakes" / "titan_metrics.jsonl"


def _torchtitan_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier) -> int:
    """torchtitan 0.2.2's FeedForward sizing (models/llama3/model/model.py), called with
    hidden_dim = 4 * dim by its TransformerBlock."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@pytest.mark.parametrize(
    "dim,ffn_dim", [(2048, 8192), (64, 160), (768, 3072), (4096, 14336), (96, 200), (512, 1000)]
)
def test_our_shape_becomes_torchtitans_model_args(dim, ffn_dim):
    fields = titan.model_fields(
        dim=dim, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=ffn_dim, vocab_size=1000,
        rope_theta=500000.0, norm_eps=1e-5,
    )  # fmt: skip
    hidden = _torchtitan_ffn_hidden(dim, fields["multiple_of"], fields["ffn_dim_multiplier"])
    assert hidden == ffn_dim
    assert (fields["dim"], fields["n_layers"], fields["n_heads"], fields["n_kv_heads"]) == (
        dim, 4, 8, 2,
    )  # fmt: skip
    assert (fields["vocab_size"], fields["rope_theta"], fields["norm_eps"]) == (
        1000,
        500000.0,
        1e-5,
    )


def _options(args: list[str]) -> dict[str, str | bool]:
    """--key value pairs, and a bare --flag as True."""
    out, i = {}, 0
    while i < len(args):
        key = args[i].removeprefix("--")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key], i = args[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


@pytest.mark.parametrize("compile", [False, True])
def test_the_command_line_sets_our_batch_precision_recompute_compile_and_lr(compile):
    args = titan.job_args(batch=4, seq_len=2048, steps=8, warmup=3, compile=compile, lr=3e-4,
                          dump_folder="/tmp/x")  # fmt: skip
    o = _options(args)
    assert o["experimental.custom_import"] == "benchmarks.gpu_pass.titan_spec"
    assert (o["model.name"], o["model.flavor"]) == (titan.SPEC_NAME, titan.FLAVOR)
    assert (o["training.local_batch_size"], o["training.seq_len"]) == ("4", "2048")
    assert o["training.steps"] == "11"  # warm-up and timed steps, one run
    assert (o["training.dtype"], o["training.mixed_precision_param"]) == ("float32", "bfloat16")
    assert o["activation_checkpoint.mode"] == "none"
    assert o["parallelism.data_parallel_shard_degree"] == "1"
    assert float(o["optimizer.lr"]) == 3e-4
    assert (o["lr_scheduler.warmup_steps"], o["lr_scheduler.decay_ratio"]) == ("0", "0")
    assert o["metrics.log_freq"] == "1"
    assert o.get("compile.enable", False) is compile


def test_the_figures_come_from_torchtitans_metrics_of_the_timed_steps():
    lines = SAMPLE.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    got = titan.parse_metrics(lines, warmup=1, steps=3)
    timed = sorted(r[titan.TPS_KEY] for r in records if r["step"] > 1)
    assert got["tokens_per_s"] == timed[1]  # the median of steps 2-4, not step 1's
    assert got["tokens_per_s"] != records[0][titan.TPS_KEY]
    assert got["loss"] == records[-1][titan.LOSS_KEY]
    assert got["peak_alloc_bytes"] == max(r[titan.PEAK_KEY] for r in records)


def test_a_missing_timed_step_is_an_error_not_a_figure():
    lines = SAMPLE.read_text().splitlines()[:-1]
    with pytest.raises(ValueError, match=r"steps \[4\]"):
        titan.parse_metrics(lines, warmup=1, steps=3)


def test_where_torchtitan_does_not_import_the_row_says_why_and_has_no_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.train", None)  # import fails
    row = titan.titan_row(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256,
        rope_theta=10000.0, norm_eps=1e-5, batch=2, seq_len=32, steps=2, warmup=1,
        compile=False, tokens_path="unused.npy", dry=True, limit_s=60,
    )  # fmt: skip
    assert row["note"].startswith("not run: torchtitan ")
    assert "not installed" in row["note"] or "does not import" in row["note"]
    assert [row[k] for k in ("tokens_per_s", "peak_alloc_bytes", "loss", "top_kernels")] == [
        None, None, None, None,
    ]  # fmt: skip
