"""benchmarks/strategies.py's tensor- and pipeline-parallel rows: every layout the script can
run passes train.py's checks as the script configures it, and a tiny run (2 ranks) puts the
default tp and pp rows beside the ddp row, each with what only its layout produces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import compose_config

from llm.validate import validate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import strategies as bench
import strategy_runs as runs


@pytest.mark.parametrize("name", list(runs.LAYOUTS))
def test_every_layout_row_passes_train_checks(tmp_path, name):
    """The script's own overrides for the row (CPU defaults: gpt2-mini, 4 blocks, global
    batch 8), so a layout that train.py would refuse cannot wait in the table as a failure."""
    a = bench.parse(["--device=cpu", "--strategies=", f"--layouts={name}"])
    [job] = bench.jobs_of(a)
    overrides = runs.overrides(a, job, tmp_path, measure=True)
    # hydra.run.dir gives a run its output_dir, which compose leaves unresolved: named here.
    kept = [o for o in overrides if not o.startswith("hydra.")]
    cfg = compose_config([*kept, f"output_dir={tmp_path}"])
    validate(cfg)
    layout = runs.LAYOUTS[name]
    p = cfg.parallelism
    assert cfg.launcher.nproc_per_node == layout.ranks == job.ranks
    assert (p.tp_size, p.pp_size) == (layout.tp, layout.pp)
    assert cfg.train.micro_batch_size * layout.dp == a.global_batch


def test_default_layouts_are_one_tensor_and_one_pipeline_row():
    names = bench.parse(["--device", "cpu"]).layout_names
    assert any(runs.LAYOUTS[n].tp > 1 for n in names)
    assert any(runs.LAYOUTS[n].pp > 1 for n in names)


@pytest.mark.slow  # six 2-rank launches: 139 s on the shared cores; the fast suite is full
def test_tiny_run_puts_tp_and_pp_rows_beside_ddp(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "bench.json"
    argv = [
        "--device=cpu",
        "--ranks=2",
        "--strategies=ddp",
        "--layouts=tp2,pp2_1f1b",
        "--model=gpt2-tiny",
        "--data=files",
        "--seq-len=32",
        "--global-batch=8",
        "--steps=3",
        "--warmup=1",
        "--measure-steps=1",
        "--retakes=0",
        f"--out={out}",
        f"--markdown={tmp_path / 'bench.md'}",
        f"--set=data.path={text_corpus}",
        f"--set=data.cache_dir={cache_dir}",
    ]
    bench.main(argv)
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["strategies"]}
    assert list(rows) == ["ddp", "tp2", "pp2_1f1b"]
    assert all(r["ok"] for r in rows.values()), {k: r["error"] for k, r in rows.items()}
    ddp, tp, pp = rows["ddp"], rows["tp2"], rows["pp2_1f1b"]
    # Communication by collective: ddp's all-reduce over dp, tp's on the tp group, and the
    # pipeline's activations crossing from stage 0 (rank 0) to stage 1.
    assert set(ddp["comm_bytes_per_step"]) == {"all_reduce"}
    assert tp["comm_bytes_per_step"]["tp.all_reduce"] > 0
    assert "all_reduce" not in tp["comm_bytes_per_step"]
    assert pp["comm_bytes_per_step"]["pp.send_activations"] > 0
    # One rank holds a part of the model: fewer parameter bytes than a ddp replica.
    for row in (tp, pp):
        assert 0 < row["model_state_bytes"]["params"] < ddp["model_state_bytes"]["params"]
        assert row["peak_memory_bytes"] > 0 and row["median_ms"] > 0
    # dp=1 with the whole global batch: the pipeline does ddp's work (tp pads the vocabulary
    # to 258, a different model).
    assert pp["final_train_loss"] == pytest.approx(ddp["final_train_loss"], rel=1e-5)
    table = (tmp_path / "bench.md").read_text()
    for name in rows:
        assert f"| 2 | {name} |" in table
