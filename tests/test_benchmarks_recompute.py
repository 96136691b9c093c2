"""benchmarks/recompute.py on a tiny shape: every policy has a row in the table and the JSON,
and the measured per-layer activation bytes are the counter's, counted here on a model built
apart from the script's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llm.config import RecomputeConfig
from llm.memory import ActivationMemoryCounter
from llm.models import build_model, materialize, model_args
from llm.recompute import apply_recompute

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import recompute as bench

POLICIES = ["none", "selective", "op_sac"]
T, B = 32, 1


def _counted_per_layer(policy: str) -> list[int]:
    args = model_args("gpt2-tiny", dropout=0.0)
    model = apply_recompute(build_model(args, "sdpa"), RecomputeConfig(name=policy))
    model = materialize(model, "cpu", seed=0).train()
    ids, targets = torch.randint(0, args.vocab_size, (2, B, T))
    with ActivationMemoryCounter(model.layers) as counter:
        logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return [counter.by_layer[f"layers.{i}"] for i in range(args.n_layers)]


def test_recompute_benchmark_tiny(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--model", "gpt2-tiny", "--seq-lens", str(T), "--batch", str(B)]
    argv += ["--backends", "sdpa", "--policies", ",".join(POLICIES), "--steps", "1"]
    argv += ["--warmup", "0", "--markdown", "--json", str(out), "--png", str(tmp_path / "r.png")]
    bench.main(argv)
    table = capsys.readouterr().out
    for policy in POLICIES:
        assert f"| sdpa | {T} | {B} | {policy} |" in table
    assert "Korthikanti" in table and "not comparable" in table  # CPU: the paper's caveat

    saved = json.loads(out.read_text())
    assert saved["command"].endswith(" ".join(argv))
    rows = {r["policy"]: r for r in saved["rows"]}
    assert list(rows) == POLICIES
    for r in rows.values():
        assert set(r) == {f.name for f in bench.Row.__dataclass_fields__.values()}
        assert r["step_ms"] > 0 and r["peak_bytes"] > r["activation_bytes"] > 0
    assert rows["none"]["overhead_pct"] == 0.0
    assert (tmp_path / "r.png").stat().st_size > 0

    # The script's figure is the counter's, independently counted; per layer the same.
    per_layer = _counted_per_layer("selective")
    assert len(set(per_layer)) == 1
    assert rows["selective"]["layer_bytes"] == per_layer[0]
    # The formula covers every policy run here, and on CPU it is exact.
    assert rows["none"]["ratio"] == rows["selective"]["ratio"] == rows["op_sac"]["ratio"] == 1.0
    assert rows["op_sac"]["layer_bytes"] < rows["none"]["layer_bytes"]
