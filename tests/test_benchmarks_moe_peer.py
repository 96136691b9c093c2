"""benchmarks/moe_peer.py (strategies.py --moe-peer): our expert parallelism beside
DeepSpeed-MoE. DeepSpeed dispatches fixed (E, C, d) buffers, so its all-to-all bytes follow
from its capacity and its ep group's size alone; ours sends the rows that leave their rank.
At ep < ranks both shard each expert slice's optimizer state over its edp = ranks / ep ranks."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import moe_peer
import moe_peer_table as table
import strategies as bench


def test_moe_table_is_off_unless_asked():
    assert bench.parse(["--device=cpu"]).moe_peer is False
    a = bench.parse(["--device=cpu", "--moe-peer", "--moe-ds-modes=full_capacity"])
    assert a.moe_peer and a.moe_ds_modes == ["full_capacity"]


def test_moe_ep_pairs_and_refusal():
    a = bench.parse(["--device=cpu", "--ranks=2,4", "--moe-peer"])
    assert moe_peer.moe_pairs(a) == [(2, 2), (4, 4)]  # default: ep = ranks
    a = bench.parse(["--device=cpu", "--ranks=2,4", "--moe-peer", "--moe-ep=1,2"])
    assert moe_peer.moe_pairs(a) == [(2, 1), (2, 2), (4, 1), (4, 2)]
    with pytest.raises(SystemExit, match=r"--moe-ep=4 does not divide --ranks 2"):
        bench.parse(["--device=cpu", "--ranks=2,4", "--moe-peer", "--moe-ep=4"])


def test_expected_optimizer_bytes_shard_experts_over_edp():
    # moe-tiny with byte tokens, counted on the meta model: 2 MoE layers x 8 SwiGLU experts
    # x 3 x 64 x 96 expert elements, the rest dense.
    a = bench.parse(["--device=cpu", "--moe-peer"])
    dense, experts = moe_peer.param_split(a)
    assert experts == 2 * 8 * 3 * 64 * 96
    # 4 ranks at ep 2: a rank holds 4 experts per layer, cut over edp 2; at ep 4 it holds 2
    # whole. The same bytes: E / ranks experts' state either way, the dense share beside it.
    at_ep2 = table.expected_optimizer_bytes(dense, experts, 4, 2, 8)
    assert at_ep2 == 8 * (dense / 4 + experts / 2 / 2)
    assert at_ep2 == table.expected_optimizer_bytes(dense, experts, 4, 4, 8)


def test_deepspeed_capacity_and_bytes_formula():
    # capacity_factor = E/k makes the top-2 capacity the rank's tokens: nothing can drop.
    assert moe_peer.deepspeed_capacity(256, 8, 2, 8 / 2) == 256
    assert moe_peer.deepspeed_capacity(10, 8, 2, 1.0) == 4  # min_capacity
    # One layer, ep 2: 4 exchanges of an (8, 100, 64) fp32 buffer, half of each leaves.
    assert moe_peer.deepspeed_a2a_bytes([100], 8, 64, 2, 4) == 4 * 0.5 * 8 * 100 * 64 * 4
    assert moe_peer.deepspeed_a2a_bytes([100, 50], 8, 64, 4, 4) == 3 * 8 * 150 * 64 * 4


def _run_table(tmp_path, text_corpus, cache_dir, seq: int, batch: int, *options: str) -> list:
    """The MoE table alone on a tiny run (3 steps, 2 measured); its JSON rows."""
    out = tmp_path / "bench.json"
    argv = [
        "--device=cpu",
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
        *options,
    ]
    bench.main(argv)
    return json.loads(out.read_text())["moe"]


@pytest.mark.slow  # six 2-rank launches (train.py and DeepSpeed): 75-110 s on 2 cores
def test_tiny_run_puts_deepspeed_moe_beside_ours(tmp_path, text_corpus, cache_dir):
    seq, batch, ranks = 32, 8, 2
    moe = _run_table(tmp_path, text_corpus, cache_dir, seq, batch, f"--ranks={ranks}")
    rows = {r["impl"]: r for r in moe}
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
    assert full["capacities"] == [[[tokens] * layers] * 2] * ranks
    # drop_tokens=False: C is the ep group's largest expert count, the buffer still (E, C, d).
    assert dropless["a2a_bytes_per_rank"] == dropless["formula_a2a_bytes_per_rank"]
    caps = [c for rank in dropless["capacities"] for step in rank for c in step]
    assert all(tokens * 2 / experts <= c <= tokens for c in caps)  # at least the mean load
    assert max(dropless["formula_a2a_bytes_per_rank"]) <= fixed
    # Ours sends only the rows that leave their rank: at most all 2 x tokens assignments out
    # and in. Out (to the other rank's E/2 experts) and in (to this rank's) are each at most
    # E/2 x C with C the largest expert count, so at most DeepSpeed's E x C slots.
    assert max(ours["a2a_bytes_per_rank"]) <= layers * 2 * 2 * (2 * tokens) * d * itemsize
    assert max(ours["a2a_bytes_per_rank"]) <= min(dropless["a2a_bytes_per_rank"])
    # Same init, data and routing (dropless, top 2 renormalised): the same first step.
    for r in (dropless, full):
        assert r["losses"][0] == pytest.approx(ours["losses"][0], rel=1e-5)
    text = (tmp_path / "bench.md").read_text()
    assert "MoE: ours vs DeepSpeed-MoE" in text
    for r in rows.values():
        assert f"| {ranks} / {ranks} | {r['label']} |" in text


@pytest.mark.slow  # four 4-rank launches (train.py and DeepSpeed): 157 s on 2 cores at load 7
def test_ep_below_ranks_shards_expert_state_over_edp(tmp_path, text_corpus, cache_dir):
    # 4 ranks at ep 2: ep groups {0, 1} and {2, 3}, edp groups {0, 2} and {1, 3}.
    seq, batch, ranks, ep = 32, 8, 4, 2
    options = (f"--ranks={ranks}", f"--moe-ep={ep}", "--moe-ds-modes=dropless")
    rows = {
        r["impl"]: r for r in _run_table(tmp_path, text_corpus, cache_dir, seq, batch, *options)
    }
    assert all(r["ok"] for r in rows.values()), {k: r["error"] for k, r in rows.items()}
    ours, ds = rows["ours"], rows["dropless"]
    assert ours["ep"] == ds["ep"] == ep
    # DeepSpeed's bytes are its formula over the ep group: each rank sends (ep-1)/ep of its
    # (E, C, d) buffers, C its own group's largest expert count. Over all 4 ranks ((N-1)/N)
    # the formula would be 1.5x what was sent.
    shape = 8, 64, ep, 4  # experts, d_model, ep, fp32 bytes
    sent = [
        statistics.mean(moe_peer.deepspeed_a2a_bytes(c, *shape) for c in steps)
        for steps in ds["capacities"]
    ]
    assert ds["a2a_bytes_per_rank"] == ds["formula_a2a_bytes_per_rank"] == sent
    over_world = moe_peer.deepspeed_a2a_bytes(ds["capacities"][0][0], 8, 64, ranks, 4)
    assert over_world == pytest.approx(
        1.5 * moe_peer.deepspeed_a2a_bytes(ds["capacities"][0][0], *shape)
    )
    # The two ranks of an ep group share its capacities.
    assert ds["capacities"][0] == ds["capacities"][1] and ds["capacities"][2] == ds["capacities"][3]
    assert min(ours["a2a_bytes_per_rank"]) > 0
    # Both shard the expert slices' optimizer state over edp: each rank holds the dense share
    # and half its 4 experts' state per layer, bucket and partition padding aside (under 1%).
    # Unsharded over edp it would hold the whole slices: 1.8x ours here.
    for r in (ours, ds):
        held = [p["optimizer_states_max"] for p in r["memory_peak"]]
        assert held == pytest.approx([r["expected_optimizer_bytes"]] * ranks, rel=0.01)
    # Same init, data and dropless top-2 routing: the same first step.
    assert ds["losses"][0] == pytest.approx(ours["losses"][0], rel=1e-5)
    assert f"| {ranks} / {ep} | ours zero2 |" in (tmp_path / "bench.md").read_text()
