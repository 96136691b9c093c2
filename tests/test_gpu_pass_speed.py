"""The speed section's resume (benchmarks/gpu_pass/speed.py): rows an earlier call measured
on the device (the runner's --resume) are kept and not measured again; a row that failed
there is measured again."""

from __future__ import annotations

from benchmarks.gpu_pass import speed


def test_earlier_rows_are_kept_and_the_rest_measured(monkeypatch):
    measured = []

    def measure(key, shape, tokens, dry, left):
        measured.append(key)
        return {"tokens_per_s": 10.0, "peak_alloc_bytes": 2**20, "loss": 1.0}

    ours = {"shape": "gpt2-tiny 2x64", "impl": "ours", "compile": False, "tokens_per_s": 5.0,
            "earlier": True}  # fmt: skip
    failed = {"shape": "llama-tiny 2x64", "impl": "ours", "compile": False,
              "tokens_per_s": None, "earlier": True}  # fmt: skip
    monkeypatch.setattr(speed, "_measure", measure)
    monkeypatch.setattr(speed, "earlier_rows", lambda: [ours, failed])
    result = speed.run(dry=True)
    planned = speed.plan(dry=True)
    assert ("gpt2", "ours", False) not in measured
    assert measured == [key for key in planned if key != ("gpt2", "ours", False)]
    assert ours in result.rows and len(result.rows) == len(planned)
    assert any("kept from an earlier record (--resume): 1 rows" in n for n in result.notes)
