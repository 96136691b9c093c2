"""benchmarks/moe_peer.py (strategies.py --moe-peer): our expert parallelism beside
DeepSpeed-MoE. DeepSpeed dispatches fixed (E, C, d) buffers, so its all-to-all bytes follow
from its capacity alone; ours sends the rows that leave their rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import moe_peer
import strategies as bench


def test_moe_table_is_off_unless_asked():
    assert bench.parse(["--device=cpu"]).moe_peer is False
    a = bench.parse(["--device=cpu", "--moe-peer", "--moe-ds-modes=full_capacity"])
    assert a.moe_peer and a.moe_ds_modes == ["full_capacity"]


def test_deepspeed_capacity_and_bytes_formula():
    # capacity_factor = E/k makes the top-2 capacity the rank's tokens: nothing can drop.
    assert moe_peer.deepspeed_capacity(256, 8, 2, 8 / 2) == 256
    assert moe_peer.deepspeed_capacity(10, 8, 2, 1.0) == 4  # min_capacity
    # One layer, ep 2: 4 exchanges of an (8, 100, 64) fp32 buffer, half of each leaves.
    assert moe_peer.deepspeed_a2a_bytes([100], 8, 64, 2, 4) == 4 * 0.5 * 8 * 100 * 64 * 4
    assert moe_peer.deepspeed_a2a_bytes([100, 50], 8, 64, 4, 4) == 3 * 8 * 150 * 64 * 4


@pytest.mark.slow  # six 2-rank launches (train.py and DeepSpeed): 75-110 s on 2 cores
def test_tiny_run_puts_deepspeed_moe_beside_ours(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "bench.json"
    seq, batch, ranks = 32, 8, 2
    argv = [
        "--device=cpu",
        f"--ranks={ranks}",
        "--strategies=",
        "--layouts=none",
        "--moe-peer",
        "--data=files",
        f"--moe-seq-len={seq}",
        f"--global-batch={batch}",
        "--steps=3",
        "--warmup=1",
        "--measure-steps=2",
        "--retakes=0",
        f"--out={out}",
        f"--markdown={tmp_path / 'bench.md'}",
        f"--set=data.path={text_corpus}",
        f"--set=data.cache_dir={cache_dir}",
    ]
    bench.main(argv)
    rows = {r["impl"]: r for r in json.loads(out.read_text())["moe"]}
    assert list(rows) == ["ours", "dropless", "full_capacity"]
    assert all(r["ok"] for r in rows.values()), {k: r["error"] for k, r in rows.items()}
    for r in rows.values():
        assert r["median_ms"] > 0
        assert len(r["a2a_bytes_per_rank"]) == len(r["peak_bytes_per_rank"]) == ranks
        assert min(r["a2a_bytes_per_rank"]) > 0 and min(r["peak_bytes_per_rank"]) > 0
    ours, dropless, full = rows["ours"], rows["dropless"], rows["full_capacity"]
    # moe-tiny: 2 MoE layers, 8 experts, d_model 64, fp32; ep = 2.
    layers, experts, d, itemsize = 2, 8, 64, 4
    tokens = batch // ranks * seq
    # capacity_factor=E/k: C is the rank's tokens whatever the routing, so the bytes follow
    # from the shape alone, on every rank.
    fixed = layers * 4 * (ranks - 1) / ranks * experts * tokens * d * itemsize
    assert full["a2a_bytes_per_rank"] == [fixed] * ranks
    assert full["capacities"] == [[tokens] * layers] * 2
    # drop_tokens=False: C is the ep group's largest expert count, the buffer still (E, C, d).
    assert dropless["a2a_bytes_per_rank"] == [dropless["formula_a2a_bytes"]] * ranks
    caps = [c for step in dropless["capacities"] for c in step]
    assert all(tokens * 2 / experts <= c <= tokens for c in caps)  # at least the mean load
    assert dropless["formula_a2a_bytes"] <= fixed
    # Ours sends only the rows that leave their rank: at most all 2 x tokens assignments out
    # and in. Out (to the other rank's E/2 experts) and in (to this rank's) are each at most
    # E/2 x C with C the largest expert count, so at most DeepSpeed's E x C slots.
    assert max(ours["a2a_bytes_per_rank"]) <= layers * 2 * 2 * (2 * tokens) * d * itemsize
    assert max(ours["a2a_bytes_per_rank"]) <= min(dropless["a2a_bytes_per_rank"])
    # Same init, data and routing (dropless, top 2 renormalised): the same first step.
    for r in (dropless, full):
        assert r["losses"][0] == pytest.approx(ours["losses"][0], rel=1e-5)
    table = (tmp_path / "bench.md").read_text()
    assert "MoE: ours vs DeepSpeed-MoE" in table
    for r in rows.values():
        assert f"| {ranks} | {r['label']} |" in table
