"""benchmarks/generate.py on a tiny run: the three rows are in the table and the JSON, their
greedy tokens equal transformers', and every row's KV cache bytes equal 2 x L x Hkv x D x
bytes x tokens held, with the tokens held counted here from the prompt lengths."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from llm.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import generate as bench

ROWS = ["transformers", "ours, contiguous", "ours, paged"]
BATCH, PROMPT, NEW, BLOCK = 3, 10, 12, 8
# (L, Hkv, D): gpt2-mini and its GQA Llama twin
SHAPES = {"gpt2": (4, 4, 32), "llama": (4, 2, 32)}


def _tokens_held(lengths: list[int]) -> dict[str, int]:
    return {
        "transformers": BATCH * (max(lengths) + NEW - 1),  # last token never fed back
        "ours, contiguous": BATCH * (max(lengths) + NEW),
        "ours, paged": sum(math.ceil((n + NEW) / BLOCK) * BLOCK for n in lengths),
    }


@pytest.mark.parametrize(
    "family, ragged", [("gpt2", False), ("llama", True)], ids=["gpt2-equal", "llama-ragged"]
)
def test_generate_benchmark_tiny(tmp_path, capsys, family, ragged):
    out = tmp_path / "g.json"
    argv = [f"--family={family}", f"--batch={BATCH}", f"--prompt={PROMPT}", f"--new={NEW}"]
    argv += ["--repeats=1", f"--block-size={BLOCK}", f"--json={out}"]
    bench.main(argv + (["--ragged"] if ragged else []))
    table = capsys.readouterr().out
    for row in ROWS:
        assert row in table
    result = json.loads(out.read_text())
    lengths = result["config"]["prompt_lengths"]
    assert lengths == ([5, 7, 10] if ragged else [PROMPT] * BATCH)
    layers, kv_heads, head_dim = SHAPES[family]
    per_token = 2 * layers * kv_heads * head_dim * 4  # fp32
    held = _tokens_held(lengths)
    rows = {r["impl"]: r for r in result["rows"]}
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert r["tokens_equal"], name
        assert r["kv_tokens"] == held[name]
        assert r["kv_bytes"] == r["kv_formula_bytes"] == per_token * held[name]
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["total_s"] > 0


def test_too_long_for_the_model_is_refused():
    with pytest.raises(ConfigError, match="positions"):
        bench.main(["--prompt=500", "--new=20", "--repeats=1"])
