"""attention=auto: the choice table built from GPU pass records, the resolver's rule (the
measured winner, the next where it cannot run here, the fallback with its reason), the
default config, and the one log line and summary entry of a run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from llm.attention import BACKENDS, choose
from llm.attention.auto import Device, load_table, resolve, resolve_for
from llm.build import model_args_for, resolve_device
from llm.precision import precision_for
from llm.validate import validate
from tests.helpers import compose_config, run

REPO = Path(__file__).resolve().parents[1]
H200 = Device("cuda", "NVIDIA H200", "9.0")
BF16 = {"dtype": torch.bfloat16, "gqa": False, "dropout": False}


def _row(backend: str, t: int, ms: float, docs: bool = False, accurate=True) -> dict:
    return {
        "backend": backend, "head_dim": 64, "seq_len": t, "docs": docs, "fwd_bwd_ms": ms,
        "fwd_bwd_tflops": 100.0 / ms, "accurate": accurate,
    }  # fmt: skip


def _record(folder: Path, rows: list[dict], device="NVIDIA H200", sha=None) -> None:
    folder.mkdir(parents=True)
    env = {"device": device, "capability": "9.0", "torch": "2.11.0+cu130"}
    shapes = "B·T = 16384 tokens, D in [64], T in [1024, 4096], bfloat16; eager up to T=4096"
    record = {
        "dry": False,
        "provenance": {"sha": sha, "dirty": False if sha else None, "note": "before commits"},
        "sections": {
            "attention": {"dry": False, "env": env, "result": {"shapes": shapes, "rows": rows}}
        },
    }
    (folder / "gpu_pass.json").write_text(json.dumps(record))


def test_the_builder_ranks_each_shape_and_names_the_record(tmp_path):
    rows = [
        _row("triton", 1024, 2.0), _row("sdpa:cudnn", 1024, 1.0),
        _row("triton", 4096, 3.0), _row("sdpa:cudnn", 4096, 4.0),
        _row("eager", 4096, 0.5, accurate=False),  # fast but wrong: never ranked
    ]  # fmt: skip
    _record(tmp_path / "2026-01-01-a", rows, sha="0123456789abcdef")
    table = choose.build_table(tmp_path, "recs")
    (entry,) = table["devices"]
    assert entry["record"] == "recs/2026-01-01-a" and entry["commit"] == "commit 0123456789ab"
    winners = {s["seq_len"]: [b for b, _ in s["ranked"]] for s in entry["shapes"]}
    assert winners == {1024: ["sdpa:cudnn", "triton"], 4096: ["triton", "sdpa:cudnn"]}
    assert {(s["dtype"], s["mask"]) for s in entry["shapes"]} == {("bfloat16", "causal")}


def test_a_later_record_of_the_device_replaces_an_earlier_one(tmp_path):
    _record(tmp_path / "2026-01-01-a", [_row("flex", 1024, 1.0)])
    _record(tmp_path / "2026-01-02-b", [_row("flex", 1024, 1.0)])
    (entry,) = choose.build_table(tmp_path, "recs")["devices"]
    assert entry["record"] == "recs/2026-01-02-b"
    assert entry["commit"].startswith("commit unknown")


def test_the_committed_table_is_what_the_committed_records_give():
    built = choose.dumps(choose.build_table(REPO / "docs/gpu_pass", "docs/gpu_pass"))
    assert choose.TABLE.read_text() == built, "run python -m llm.attention.choose"


def _fake(ranked_1k: list[str], ranked_4k: list[str]) -> dict:
    shapes = [
        {"dtype": "bfloat16", "head_dim": 64, "mask": "causal", "seq_len": t,
         "ranked": [[name, 100.0 - i] for i, name in enumerate(ranked)]}
        for t, ranked in ((1024, ranked_1k), (4096, ranked_4k))
    ]  # fmt: skip
    entry = {"device": "NVIDIA H200", "capability": "9.0", "record": "recs/x", "commit": "c"}
    return {"devices": [{**entry, "torch": "2.11", "shapes": shapes}]}


def _pick(table, device=H200, head_dim=64, seq_len=1024, **kw):
    kw = {**BF16, **kw}
    return resolve(
        "auto", "auto", device=device, head_dim=head_dim, seq_len=seq_len,
        document_mask=False, table=table, **kw,
    )  # fmt: skip


def test_the_measured_winner_at_the_nearest_shape():
    table = _fake(["sdpa:cudnn", "flex"], ["flex", "sdpa:cudnn"])
    got = _pick(table)
    assert (got.backend, got.kernel) == ("sdpa", "cudnn")
    assert "fastest, 100 TFLOP/s" in got.why and "row D=64 T=1024" in got.why
    assert "recs/x (c)" in got.why and got.why.startswith("attention=auto on NVIDIA H200 (9.0)")
    # T=3000 is nearer 4096 than 1024 on a log2 scale; D=80 takes the one head dim measured.
    assert _pick(table, seq_len=3000, head_dim=80).backend == "flex"
    # T=2048 is as near either: the larger wins.
    assert _pick(table, seq_len=2048).backend == "flex"
    # Another device of the same compute capability takes its measurements, and says so.
    h100 = _pick(table, device=Device("cuda", "NVIDIA H100 80GB HBM3", "9.0"))
    assert h100.kernel == "cudnn" and "measured on NVIDIA H200" in h100.why


def test_a_winner_that_cannot_run_here_gives_way_to_the_next(monkeypatch):
    # As where flash-attn is not installed: check_kernel's unavailability refusal.
    missing = dataclasses.replace(
        BACKENDS["flash_attn"]["auto"], unavailable=lambda: "flash_attn needs the package"
    )
    monkeypatch.setitem(BACKENDS, "flash_attn", {"auto": missing})
    got = _pick(_fake(["flash_attn", "sdpa:cudnn"], ["flex"]))
    assert (got.backend, got.kernel) == ("sdpa", "cudnn")
    assert "fastest that runs here" in got.why
    assert "flash_attn cannot run here (flash_attn needs the package)" in got.why
    # sdpa's cuDNN kernel takes no fp32, and the records measured none: the fallback.
    fp32 = _pick(_fake(["sdpa:cudnn"], ["flex"]), dtype=torch.float32)
    assert (fp32.backend, fp32.kernel) == ("sdpa", "auto") and "no float32" in fp32.why
    # Nothing measured runs (cudnn refuses head dim 256): the fallback, with each refusal.
    none = _pick(_fake(["sdpa:cudnn"], ["sdpa:cudnn"]), head_dim=256)
    assert none.kernel == "auto" and "no backend measured in row D=64" in none.why
    assert "takes head dims" in none.why


@pytest.mark.parametrize(
    "device,reason",
    [
        (Device("cpu"), "no GPU here"),
        (Device("cuda", "NVIDIA A100-SXM4-80GB", "8.0"), "no committed GPU record for NVIDIA A100"),
    ],
)
def test_the_fallback_is_sdpa_with_its_reason(device, reason):
    got = _pick(load_table(), device=device)
    assert (got.backend, got.kernel, got.requested) == ("sdpa", "auto", "auto")
    assert reason in got.why and "attention=sdpa:" in got.why


def test_a_named_backend_is_kept():
    got = resolve("eager", "auto", device=H200, head_dim=64, seq_len=1024,
                  document_mask=False, **BF16)  # fmt: skip
    assert (got.backend, got.requested, got.why) == ("eager", "eager", "named in the config")


def test_the_committed_table_picks_cudnn_on_hopper():
    # The H200 record: SDPA's cuDNN kernel wins every causal shape without documents.
    for t in (1024, 16384):
        for d in (64, 128):
            got = _pick(load_table(), head_dim=d, seq_len=t)
            assert (got.backend, got.kernel) == ("sdpa", "cudnn"), got.why


def test_auto_is_the_default_and_falls_back_on_cpu(tmp_path):
    cfg = compose_config([f"output_dir={tmp_path}", "train.device=cpu"])  # no model, no data
    assert (cfg.attention.backend, cfg.attention.sdpa_kernel) == ("auto", "auto")
    cpu = resolve_device(cfg)
    dtype = precision_for(cfg, cpu).compute_dtype
    got = resolve_for(cfg.attention, model_args_for(cfg), device=cpu, dtype=dtype, seq_len=256)
    assert (got.backend, got.kernel) == ("sdpa", "auto") and "no GPU here" in got.why
    validate(cfg)  # the default config passes as it did with attention=sdpa


def test_a_run_logs_the_choice_once_and_records_it(tmp_path, text_corpus, cache_dir, capfd):
    summary, _ = run(tmp_path, "auto", text_corpus, cache_dir, "train.max_steps=2")
    said = [line for line in capfd.readouterr().err.splitlines() if "attention=auto on" in line]
    assert len(said) == 1 and "attention=sdpa: no GPU here" in said[0]
    assert summary["attention"]["requested"] == "auto"
    assert (summary["attention"]["backend"], summary["attention"]["sdpa_kernel"]) == (
        "sdpa",
        "auto",
    )
