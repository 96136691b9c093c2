"""The GPU pass (benchmarks/gpu_pass) without a GPU: its dry run covers every section with
the packages it must do without blocked; the runner survives a section that fails or hangs
and keeps what a cut-short section finished; publish writes the docs' blocks and nothing
else; the wheel list and the README's device line hold to their limits; the attention
section's FLOP count and reference are exact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_pass import __main__ as runner
from benchmarks.gpu_pass import publish, wheels
from benchmarks.gpu_pass.attention import allowed_pairs, doc_ids, reference
from benchmarks.gpu_pass.report import load
from benchmarks.gpu_pass.sections import SECTIONS, Section
from llm.attention import attention

REPO = Path(__file__).resolve().parent.parent
NOT_ON_THE_PASS = ("wandb", "datasets", "deepspeed", "bitsandbytes")


def _blocked_packages(root: Path) -> Path:
    """A folder of packages that refuse to import, first on PYTHONPATH."""
    for name in NOT_ON_THE_PASS:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the GPU pass must run without it')\n"
        )
    return root


# About a minute (every section's process, nine of them): the slow suite keeps the fast one
# under 15 minutes; the runner's own tests below stay fast.
@pytest.mark.slow
def test_dry_run_runs_every_section_without_the_packages_a_gpu_image_lacks(tmp_path):
    """`make gpu-pass DRY=1`: every section's code path on CPU, each ok with rows, while
    wandb, datasets, deepspeed and bitsandbytes cannot be imported."""
    blocked = _blocked_packages(tmp_path / "blocked")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(REPO)]))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_pass", "--dry", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    log = (out / "gpu_pass.log").read_text() if (out / "gpu_pass.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + log[-5000:]
    record = load(out)
    assert record["dry"] and list(record["sections"]) == [s.name for s in SECTIONS]
    for name, entry in record["sections"].items():
        assert entry["status"] == "ok", (name, entry["status"])
        assert entry["result"]["rows"], name
        # A dry run judges no speed or memory goal; a goal it can judge on CPU (the kernels'
        # accuracy against fp32) must hold.
        assert all(g["met"] is not False for g in entry["result"]["goals"]), name
    md = (out / "gpu_pass.md").read_text()
    assert all(f"#### {s.name}:" in md for s in SECTIONS)
    # The sections that needed a blocked package say so instead of failing.
    notes = " ".join(record["sections"]["optimizers"]["result"]["notes"])
    assert "adamw8bit: not run" in notes


def _section(module: str) -> Section:
    return Section(module.rsplit(".", 1)[-1], 1, 10, module)


def test_a_section_past_its_limit_is_killed_and_keeps_its_rows(tmp_path):
    with (tmp_path / "log").open("w") as log:
        status, seconds, result = runner.run_section(
            _section("tests.gpu_pass_fakes.slow"), dry=True, limit=8, log=log
        )
    assert status.startswith("timed out after 8") and "kept" in status
    assert result["rows"] == [{"x": 1}]
    assert seconds < 60


def test_a_failing_section_is_reported_and_the_next_one_runs(tmp_path, monkeypatch):
    fakes = [_section("tests.gpu_pass_fakes.broken"), _section("tests.gpu_pass_fakes.quick")]
    monkeypatch.setattr(runner, "selected", lambda part, only: fakes)
    code = runner.main(["--dry", "--out", str(tmp_path)])
    record = load(tmp_path)
    assert code == 1
    assert record["sections"]["broken"]["status"].startswith("failed (exit 1")
    assert record["sections"]["broken"]["result"] is None
    assert record["sections"]["quick"]["status"] == "ok"
    assert "this section is broken on purpose" in (tmp_path / "gpu_pass.log").read_text()
    assert "Failed: broken." in (tmp_path / "gpu_pass.md").read_text()


def _fake_run(status="ok", rows=({"x": 1},)):
    def run_section(section, dry, limit, log, earlier_rows=None):
        result = {"title": section.name, "shapes": "-", "columns": ["x"], "rows": list(rows),
                  "goals": [], "notes": []}  # fmt: skip
        return status, 1.0, result

    return run_section


def test_a_second_part_joins_the_record_of_the_first(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_section", _fake_run())
    runner.main(["--part", "1", "--out", str(tmp_path), "--dry"])
    runner.main(["--part", "2", "--out", str(tmp_path), "--dry"])
    assert list(load(tmp_path)["sections"]) == [s.name for s in SECTIONS]


def test_a_record_of_another_mode_is_not_joined(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_section", _fake_run())
    runner.main(["--part", "1", "--out", str(tmp_path), "--dry"])
    record = load(tmp_path)
    record["dry"] = False  # as if a GPU run had written it
    (tmp_path / "gpu_pass.json").write_text(json.dumps(record))
    runner.main(["--part", "2", "--out", str(tmp_path), "--dry"])
    assert {e["part"] for e in load(tmp_path)["sections"].values()} == {2}


def _dry_attention(out: Path, resume: Path | None = None, *more: str) -> dict:
    argv = ["--dry", "--only", "attention", "--out", str(out)]
    assert runner.main(argv + (["--resume", str(resume)] if resume else []) + list(more)) == 0
    return load(out)["sections"]["attention"]


def _key(row: dict) -> tuple:
    return row["backend"], row["head_dim"], row["seq_len"], row["docs"]


def test_resume_keeps_an_earlier_calls_attention_rows_and_measures_only_the_rest(tmp_path):
    first = _dry_attention(tmp_path / "first")["result"]["rows"]
    # The earlier call ran out of time after all but its last row.
    cut = load(tmp_path / "first")
    cut["sections"]["attention"]["result"]["rows"] = first[:-1]
    (tmp_path / "first" / "gpu_pass.json").write_text(json.dumps(cut))
    entry = _dry_attention(tmp_path / "second", tmp_path / "first")
    rows = entry["result"]["rows"]
    assert sorted(map(_key, rows)) == sorted(map(_key, first))
    assert [r.get("earlier", False) for r in rows] == [True] * (len(first) - 1) + [False]
    assert _key(rows[-1]) == _key(first[-1])
    assert f"{len(first) - 1} rows kept" in " ".join(entry["result"]["notes"])
    assert entry["command"].endswith(f"--resume {tmp_path / 'first'}")
    # --redo measures one backend's kept rows again (a kernel fixed since), the rest kept.
    redo = first[0]["backend"]
    again = _dry_attention(tmp_path / "third", tmp_path / "first", "--redo", redo)
    assert {_key(r): r.get("earlier", False) for r in again["result"]["rows"]} == {
        _key(r): r["backend"] != redo and r is not first[-1] for r in first
    }


def test_resume_refuses_a_record_of_another_device_or_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_section", _fake_run())
    runner.main(["--part", "1", "--out", str(tmp_path / "gpu"), "--dry"])
    record = load(tmp_path / "gpu")
    record["dry"], record["env"]["device"] = False, "NVIDIA H200"
    (tmp_path / "gpu" / "gpu_pass.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="from NVIDIA H200, not this CPU"):
        runner.main(["--dry", "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "gpu")])
    with pytest.raises(SystemExit, match=r"no gpu_pass\.json there"):
        runner.main(["--dry", "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "none")])


def test_resumed_cuda_tests_that_passed_are_not_run_again(tmp_path, monkeypatch):
    from benchmarks.gpu_pass import gpu_tests

    ids = ["tests/a.py::test_one", "tests/a.py::test_two"]
    monkeypatch.setattr(gpu_tests, "_collect", lambda: [{"test": i} for i in ids])
    earlier = [{"test": ids[0], "outcome": "passed", "message": ""},
               {"test": ids[1], "outcome": "failed", "message": "boom"}]  # fmt: skip
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    monkeypatch.setenv("GPU_PASS_EARLIER_JSON", str(tmp_path / "earlier.json"))
    started = []

    class Pytest:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            self.stdout = iter([f"{ids[1]} PASSED\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(gpu_tests.subprocess, "Popen", Pytest)
    rows = {r["test"]: r for r in gpu_tests._run_tests()}
    # The passed test is deselected and kept; the failed one runs again.
    assert started[0][-2:] == ["--deselect", ids[0]]
    assert rows[ids[0]]["outcome"] == "passed" and rows[ids[0]]["earlier"]
    assert rows[ids[1]]["outcome"] == "passed" and "earlier" not in rows[ids[1]]


def test_limits_scale_and_override(tmp_path):
    a = runner.parse(["--limit-scale", "0.5", "--limit", "attention=42"])
    got = runner.limits(SECTIONS, a)
    gpu_tests = next(s for s in SECTIONS if s.name == "gpu_tests")
    assert got["attention"] == 42 and got["gpu_tests"] == round(gpu_tests.limit_s * 0.5)
    with pytest.raises(SystemExit, match="--limit nope=3"):
        runner.limits(SECTIONS, runner.parse(["--limit", "nope=3"]))


def _record(out: Path, sections: dict, dry: bool = False) -> None:
    env = {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
           "date": "2026-11-26"}  # fmt: skip
    entries = {
        name: {"part": 1, "status": "ok", "seconds": 3.0, "dry": dry, "env": env,
               "command": f"python -m benchmarks.gpu_pass --only {name}",
               "result": None if rows is None else {
                   "title": f"{name} table", "shapes": "s", "columns": ["x"],
                   "rows": [{"x": v} for v in rows], "goals": [], "notes": []}}
        for name, rows in sections.items()
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pass.json").write_text(json.dumps({"env": env, "dry": dry, "sections": entries}))


def _docs(root: Path) -> None:
    for page in set(publish.PAGES.values()):
        names = [n for n, p in publish.PAGES.items() if p == page]
        blocks = "".join(
            f"before {n}\n<!-- gpu-pass:{n} -->\npending\n<!-- /gpu-pass:{n} -->\nafter {n}\n"
            for n in names
        )
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        (root / page).write_text(f"# {page}\n{blocks}")


def test_publish_replaces_each_block_and_nothing_else(tmp_path):
    _docs(tmp_path)
    _record(tmp_path / "run1", {"attention": [1, 2], "estimator": [3]})
    _record(tmp_path / "run2", {"attention": [7], "estimator": None})
    pages = publish.publish([tmp_path / "run1", tmp_path / "run2"], root=tmp_path)
    assert pages == ["docs/attention.md", "docs/recompute.md"]
    text = (tmp_path / "docs/attention.md").read_text()
    # The later run's rows replace the earlier's; the text around the block is untouched.
    assert "| 7 |" in text and "| 1 |" not in text and "pending" not in text
    assert text.startswith("# docs/attention.md\nbefore attention\n<!-- gpu-pass:attention -->")
    assert text.endswith("<!-- /gpu-pass:attention -->\nafter attention\n")
    assert "NVIDIA H200" in text and "2026-11-26" in text
    recompute = (tmp_path / "docs/recompute.md").read_text()
    # A later entry without rows does not replace one with rows; an unrun section stays.
    assert "| 3 |" in recompute
    assert "<!-- gpu-pass:recompute -->\npending\n" in recompute
    assert "pending" in (tmp_path / "docs/benchmarks.md").read_text()


def test_publish_refuses_a_missing_block_and_a_dry_record(tmp_path):
    _docs(tmp_path)
    (tmp_path / "docs/attention.md").write_text("no block here\n")
    _record(tmp_path / "run", {"attention": [1]})
    with pytest.raises(SystemExit, match=r"docs/attention.md has no <!-- gpu-pass:attention"):
        publish.publish([tmp_path / "run"], root=tmp_path)
    _record(tmp_path / "dry", {"attention": [1]}, dry=True)
    with pytest.raises(SystemExit, match="a dry run's record"):
        publish.publish([tmp_path / "dry"], root=tmp_path)


def test_the_docs_hold_every_block_publish_writes():
    for name, page in publish.PAGES.items():
        assert publish.block(name).search((REPO / page).read_text()), (name, page)


def test_the_wheel_list_is_pinned_and_leaves_out_what_the_pass_does_without(tmp_path):
    specs = wheels.pinned(REPO / "requirements-gpu.txt")
    names = {s.split("==")[0].lower().replace("_", "-") for s in specs}
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "torchao"} <= names
    assert not names & set(NOT_ON_THE_PASS)
    loose = tmp_path / "list.txt"
    loose.write_text("hydra-core>=1.3\n")
    with pytest.raises(SystemExit, match="not pinned"):
        wheels.pinned(loose)


def test_the_readme_device_line_fits_one_command():
    text = (REPO / "README.md").read_text()
    section = text.split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"```bash\n(.*?)\n```", section, re.DOTALL)
    assert len(lines) == 1 and "\n" not in lines[0]
    line = lines[0]
    assert len(line) <= 2000
    assert ".whl/*.whl" in line and "--no-index" in line and "benchmarks.gpu_pass --part" in line


@pytest.mark.parametrize("t", [64, 100])
def test_attention_flops_count_the_pairs_the_mask_allows(t):
    ids = doc_ids(2, t, "cpu")
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    exact = allowed.sum().item()
    # The convention counts L²/2 per document; the exact count adds L/2 (the diagonal).
    lengths = torch.cat([torch.unique_consecutive(r, return_counts=True)[1] for r in ids])
    assert allowed_pairs(ids, 2, t) == pytest.approx(exact - lengths.sum().item() / 2)
    assert allowed_pairs(None, 2, t) == 2 * t * t / 2


def test_attention_reference_is_masked_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 48, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ids = doc_ids(2, 48, "cpu")
    from llm.attention import Documents

    want = attention(q, k, v, causal=True, backend="eager", docs=Documents(ids))
    torch.testing.assert_close(reference(q, k, v, ids).double(), want, rtol=1e-5, atol=1e-5)
