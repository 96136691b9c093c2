"""The GPU pass (benchmarks/gpu_pass) without a GPU: its dry run covers every section with
the packages it must do without blocked; the runner survives a section that fails or hangs
and keeps what a cut-short section finished; every record names its commit and each
section's digest, and --resume keeps rows only where the digest holds; publish writes the
docs' blocks and nothing else, refuses a dirty tree's record and labels one of unknown
commit; no goal is met with nothing measured; the wheel list and the README's device line
hold to their limits; the attention section's FLOP count and reference are exact."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_pass import __main__ as runner
from benchmarks.gpu_pass import provenance, publish, wheels
from benchmarks.gpu_pass.attention import allowed_pairs, doc_ids, reference
from benchmarks.gpu_pass.common import NOT_MEASURED
from benchmarks.gpu_pass.report import goal_line, load
from benchmarks.gpu_pass.sections import SECTIONS, Section
from llm.attention import attention

REPO = Path(__file__).resolve().parent.parent
NOT_ON_THE_PASS = ("wandb", "datasets", "bitsandbytes")


def _blocked_packages(root: Path) -> Path:
    """A folder of packages that refuse to import, first on PYTHONPATH."""
    for name in NOT_ON_THE_PASS:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the GPU pass must run without it')\n"
        )
    return root


# About a minute (every section's process, ten of them): the slow suite keeps the fast one
# under 15 minutes; the runner's own tests below stay fast.
@pytest.mark.slow
def test_dry_run_runs_every_section_without_the_packages_a_gpu_image_lacks(tmp_path):
    """`make gpu-pass DRY=1`: every section's code path on CPU, each ok with rows, while
    wandb, datasets and bitsandbytes cannot be imported."""
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
    # The record names the commit and, per section, the digest of the files it read.
    assert set(record["provenance"]["digests"]) == {s.name for s in SECTIONS}
    assert "tests/test_gpu.py" in record["sections"]["gpu_tests"]["provenance"]["files"]
    assert "conf/config.yaml" in record["sections"]["estimator"]["provenance"]["files"]
    # The sections that needed a blocked package say so instead of failing.
    notes = " ".join(record["sections"]["optimizers"]["result"]["notes"])
    assert "adamw8bit: not run" in notes


def _section(module: str) -> Section:
    return Section(module.rsplit(".", 1)[-1], 1, 10, module)


@pytest.mark.slow
def test_a_section_past_its_limit_is_killed_and_keeps_its_rows(tmp_path):
    with (tmp_path / "log").open("w") as log:
        status, seconds, result, modules = runner.run_section(
            _section("tests.gpu_pass_fakes.slow"), dry=True, limit=8, log=log
        )
    assert status.startswith("timed out after 8") and "kept" in status
    assert result["rows"] == [{"x": 1}]
    # What it had imported by its last partial write names the files its rows depend on.
    assert "tests/gpu_pass_fakes/slow.py" in modules
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


def _fake_run(status="ok", rows=({"x": 1},), modules=(), earlier=None):
    """A run_section that runs nothing; ``earlier`` collects the rows --resume hands it."""

    def run_section(section, dry, limit, log, earlier_rows=None):
        if earlier is not None:
            earlier.append(earlier_rows)
        result = {"title": section.name, "shapes": "-", "columns": ["x"], "rows": list(rows),
                  "goals": [], "notes": []}  # fmt: skip
        return status, 1.0, result, list(modules)

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


@pytest.mark.slow
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


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.slow
def test_a_run_names_its_commit_and_each_sections_files(tmp_path, monkeypatch):
    """A dry run of a real section process: the record names git's HEAD and whether the
    tree had changes, and the section's digest covers the repository files it imported."""
    monkeypatch.setattr(
        runner, "selected", lambda part, only: [_section("tests.gpu_pass_fakes.quick")]
    )
    assert runner.main(["--dry", "--out", str(tmp_path)]) == 0
    record = load(tmp_path)
    prov, entry = record["provenance"], record["sections"]["quick"]["provenance"]
    assert prov["sha"] == _git(REPO, "rev-parse", "HEAD") and prov["source"] == "git"
    assert isinstance(prov["dirty"], bool)
    assert {"tests/gpu_pass_fakes/quick.py", "benchmarks/gpu_pass/common.py"} <= set(entry["files"])
    assert all(h is not None and not f.startswith(".venv") for f, h in entry["files"].items())
    assert entry["digest"] == provenance.digest(entry["files"]) == prov["digests"]["quick"]
    assert f"From commit {prov['sha'][:12]}" in (tmp_path / "gpu_pass.md").read_text()


def _resume_tree(tmp_path, monkeypatch) -> tuple[Path, list]:
    """A repository of one file, ``a.py``, that a fake section imports; returns the tree and
    the list where the fake section collects the rows --resume hands it."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("A = 1\n")
    monkeypatch.setattr(runner, "REPO", tree)
    monkeypatch.setattr(runner, "selected", lambda part, only: [_section("fake.quick")])
    handed: list = []
    monkeypatch.setattr(runner, "run_section", _fake_run(modules=["a.py"], earlier=handed))
    runner.main(["--dry", "--out", str(tmp_path / "first")])
    return tree, handed


def test_resume_keeps_rows_whose_digest_holds_and_drops_the_others(tmp_path, monkeypatch, capsys):
    tree, handed = _resume_tree(tmp_path, monkeypatch)
    first = load(tmp_path / "first")
    assert first["sections"]["quick"]["provenance"]["files"] == {
        "a.py": provenance.file_hash(tree / "a.py")
    }
    runner.main(["--dry", "--out", str(tmp_path / "same"), "--resume", str(tmp_path / "first")])
    assert handed[-1] == [{"x": 1}]  # the same file: the earlier rows are kept
    (tree / "a.py").write_text("A = 2\n")
    runner.main(["--dry", "--out", str(tmp_path / "changed"), "--resume", str(tmp_path / "first")])
    assert handed[-1] == []
    line = f"--resume {tmp_path / 'first'}: quick's 1 rows dropped: its files changed since: a.py"
    assert line in capsys.readouterr().out


def test_resume_drops_the_rows_of_a_record_that_names_no_digest(tmp_path, monkeypatch, capsys):
    _, handed = _resume_tree(tmp_path, monkeypatch)
    legacy = load(tmp_path / "first")
    del legacy["sections"]["quick"]["provenance"]  # as the records before provenance
    (tmp_path / "first" / "gpu_pass.json").write_text(json.dumps(legacy))
    runner.main(["--dry", "--out", str(tmp_path / "o"), "--resume", str(tmp_path / "first")])
    assert handed[-1] == []
    assert "quick's 1 rows dropped: its record names no digest" in capsys.readouterr().out


def test_a_stamp_carries_the_commit_to_a_copy_without_git_and_a_changed_copy_is_refused(tmp_path):
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    repo.mkdir()
    (repo / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    (repo / "b.py").write_text("B = 1\n")  # untracked, not ignored: it travels, and is a change
    stamp = provenance.stamp(repo)
    assert stamp["sha"] == _git(repo, "rev-parse", "HEAD") and stamp["dirty"] is True
    assert set(stamp["files"]) == {"a.py", "b.py"}
    # The stamp itself leaves the tree as clean or dirty as it was.
    (repo / "b.py").unlink()
    assert provenance.current(repo).dirty is False
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "b.py").write_text("B = 1\n")
    tree = provenance.current(copy)
    assert (tree.sha, tree.dirty, tree.source) == (stamp["sha"], True, provenance.STAMP_NAME)
    (copy / "a.py").write_text("A = 2\n")
    with pytest.raises(SystemExit, match=r"1 files changed since it was written \(first: a\.py\)"):
        provenance.current(copy)
    (copy / provenance.STAMP_NAME).unlink()
    assert provenance.current(copy).record() == {
        "sha": None, "dirty": None, "source": None, "note": "no git and no stamp where it ran"
    }  # fmt: skip


def test_a_matching_stamp_outranks_a_stale_git_that_travelled_with_the_copy(tmp_path):
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    repo.mkdir()
    commit = ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am")
    (repo / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "a.py")
    _git(repo, *commit, "a")
    (repo / "a.py").write_text("A = 2\n")
    _git(repo, *commit, "b")
    stamp = provenance.stamp(repo)
    assert stamp["dirty"] is False
    shutil.copytree(repo, copy)
    _git(copy, "reset", "-q", "--soft", "HEAD~1")  # the copy's .git one commit behind
    tree = provenance.current(copy)
    assert (tree.sha, tree.dirty, tree.source) == (stamp["sha"], False, provenance.STAMP_NAME)
    (copy / "a.py").write_text("A = 3\n")  # the stamp no longer holds: git's answer stands
    tree = provenance.current(copy)
    assert tree.source == "git" and tree.dirty is True and tree.sha != stamp["sha"]


def test_a_file_a_section_read_that_the_stamp_does_not_list_makes_the_record_dirty():
    tree = provenance.Tree("d" * 40, False, provenance.STAMP_NAME, {"a.py"})
    record = {"sections": {"quick": {"provenance": provenance.section_files([], ())}}}
    assert runner.record_provenance(record, tree)["dirty"] is False
    record["sections"]["quick"]["provenance"]["files"]["new.py"] = "0"
    prov = runner.record_provenance(record, tree)
    assert prov["dirty"] is True and "new.py" in prov["note"]


def test_limits_scale_and_override(tmp_path):
    a = runner.parse(["--limit-scale", "0.5", "--limit", "attention=42"])
    got = runner.limits(SECTIONS, a)
    gpu_tests = next(s for s in SECTIONS if s.name == "gpu_tests")
    assert got["attention"] == 42 and got["gpu_tests"] == round(gpu_tests.limit_s * 0.5)
    with pytest.raises(SystemExit, match="--limit nope=3"):
        runner.limits(SECTIONS, runner.parse(["--limit", "nope=3"]))


def _record(out: Path, sections: dict, dry: bool = False, sha=None, dirty=None) -> None:
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
    note = {} if sha else {"note": provenance.UNKNOWN_NOTE}
    record = {"env": env, "dry": dry, "provenance": {"sha": sha, "dirty": dirty, **note},
              "sections": entries}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pass.json").write_text(json.dumps(record))


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
    _record(tmp_path / "run1", {"attention": [1, 2], "estimator": [3]}, sha="a" * 40, dirty=False)
    _record(tmp_path / "run2", {"attention": [7], "estimator": None})
    pages = publish.publish([tmp_path / "run1", tmp_path / "run2"], root=tmp_path)
    assert pages == ["docs/attention.md", "docs/recompute.md"]
    text = (tmp_path / "docs/attention.md").read_text()
    # The later run's rows replace the earlier's; the text around the block is untouched.
    assert "| 7 |" in text and "| 1 |" not in text and "pending" not in text
    assert text.startswith("# docs/attention.md\nbefore attention\n<!-- gpu-pass:attention -->")
    assert text.endswith("<!-- /gpu-pass:attention -->\nafter attention\n")
    assert "NVIDIA H200" in text and "2026-11-26" in text
    # Each block names the record its figures came from, and that record's commit.
    assert "Record: `run2`, commit unknown: recorded before records named their commit." in text
    recompute = (tmp_path / "docs/recompute.md").read_text()
    # A later entry without rows does not replace one with rows; an unrun section stays.
    assert "| 3 |" in recompute and f"Record: `run1`, commit {'a' * 12}.\n" in recompute
    assert "<!-- gpu-pass:recompute -->\npending\n" in recompute
    assert "pending" in (tmp_path / "docs/benchmarks.md").read_text()


def test_publish_refuses_a_missing_block_a_dry_record_and_a_dirty_tree(tmp_path):
    _docs(tmp_path)
    (tmp_path / "docs/attention.md").write_text("no block here\n")
    _record(tmp_path / "run", {"attention": [1]})
    with pytest.raises(SystemExit, match=r"docs/attention.md has no <!-- gpu-pass:attention"):
        publish.publish([tmp_path / "run"], root=tmp_path)
    _record(tmp_path / "dry", {"attention": [1]}, dry=True)
    with pytest.raises(SystemExit, match="a dry run's record"):
        publish.publish([tmp_path / "dry"], root=tmp_path)
    # A dirty record among clean ones: refused in one line before any page is written.
    _docs(tmp_path)
    before = (tmp_path / "docs/recompute.md").read_text()
    _record(tmp_path / "clean", {"estimator": [1]}, sha="b" * 40, dirty=False)
    _record(tmp_path / "dirty", {"attention": [1]}, sha="b" * 40, dirty=True)
    with pytest.raises(SystemExit, match="uncommitted changes") as refused:
        publish.publish([tmp_path / "clean", tmp_path / "dirty"], root=tmp_path)
    assert "\n" not in str(refused.value.code)
    assert (tmp_path / "docs/recompute.md").read_text() == before


def test_every_section_has_a_page_and_its_block_is_there():
    for section in SECTIONS:
        page = publish.PAGES[section.name]
        assert publish.block(section.name).search((REPO / page).read_text()), (section, page)


def test_publish_over_every_committed_record_runs_clean_and_matches_the_docs(tmp_path):
    """`make gpu-publish` with no OUT: every record under docs/gpu_pass/, oldest first; a
    section none holds is pending. The docs as committed are its output."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    records = publish.committed(tmp_path)
    assert records and [r.name[:10] for r in records] == sorted(r.name[:10] for r in records)
    pages = publish.publish(records, root=tmp_path, pending=True)
    assert set(pages) == {publish.PAGES[s.name] for s in SECTIONS}
    for page in pages:
        assert (tmp_path / page).read_text() == (REPO / page).read_text(), page
    for record in records:  # each names its commit, or says it is unknown
        prov = load(record)["provenance"]
        assert prov["dirty"] is False or (prov["sha"] is None and prov["note"]), record


def test_records_of_one_day_publish_in_their_commits_order(tmp_path):
    """Within a day the commit decides, not the folder's name: "a" ran from HEAD, "b" from
    no named commit (as the first records), so "b" is the older."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    gpu_pass = tmp_path / "docs/gpu_pass"
    _record(gpu_pass / "2026-01-01-a", {"attention": [1]}, sha=head, dirty=False)
    _record(gpu_pass / "2026-01-01-b", {"attention": [2]}, sha=None, dirty=False)
    _record(gpu_pass / "2025-12-31-z", {"attention": [3]}, sha=head, dirty=False)
    names = [r.name for r in publish.committed(tmp_path)]
    assert names == ["2025-12-31-z", "2026-01-01-b", "2026-01-01-a"]


def test_publish_with_no_record_of_a_section_leaves_it_pending(tmp_path):
    _docs(tmp_path)
    _record(tmp_path / "docs/gpu_pass/2026-01-01-a", {"attention": [1]}, sha="c" * 40, dirty=False)
    publish.publish(publish.committed(tmp_path), root=tmp_path, pending=True)
    inference = (tmp_path / "docs/inference.md").read_text()
    for name in ("inference", "quantization"):
        assert f"<!-- gpu-pass:{name} -->\n{publish.PENDING}<!-- /gpu-pass" in inference
    assert "| 1 |" in (tmp_path / "docs/attention.md").read_text()


def test_the_wheel_list_is_pinned_and_leaves_out_what_the_pass_does_without(tmp_path):
    specs = wheels.pinned(REPO / "requirements-gpu.txt")
    names = {s.split("==")[0].lower().replace("_", "-") for s in specs}
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "torchao"} <= names
    assert {"deepspeed", "pydantic", "hjson"} <= names  # the nccl section's deepspeed rows
    # torchtitan's trainer imports datasets unconditionally: it travels for that row only.
    assert {"torchtitan", "datasets"} <= names
    assert not names & (set(NOT_ON_THE_PASS) - {"datasets"})
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


def _goals_of(section: str, rows: list[dict]) -> list[dict]:
    """The goals section ``section`` judges on ``rows`` as a GPU run (not dry) would."""
    from benchmarks.gpu_pass import attention, estimator, gpu_tests, model_step, recompute

    goals = {
        "attention": lambda: attention._result(rows, [], [], dry=False).goals,
        "estimator": lambda: [estimator._goal(rows, [], dry=False)],
        "gpu_tests": lambda: [gpu_tests._goal(rows, dry=False)],
        "model_step": lambda: model_step._goals(rows, dry=False),
        "recompute": lambda: [recompute._goal(rows, dry=False)],
    }[section]()
    return [asdict(g) for g in goals]


GOAL_SECTIONS = ["attention", "estimator", "gpu_tests", "model_step", "recompute"]


@pytest.mark.parametrize("section", GOAL_SECTIONS)
def test_no_goal_is_met_with_nothing_measured(section):
    goals = _goals_of(section, [])
    assert goals and all(g["met"] is None and g["value"] == NOT_MEASURED for g in goals)
    assert all(goal_line(g).endswith(": not measured") for g in goals)


def _attention_row(backend: str, tflops: float, **more) -> dict:
    return {"backend": backend, "head_dim": 128, "seq_len": 2048, "docs": False,
            "fwd_tflops": tflops, "fwd_bwd_tflops": tflops, **more}  # fmt: skip


MISSED = {
    "attention": [_attention_row("triton", 90.0, accurate=False),
                  _attention_row("sdpa:flash", 100.0, accurate=True)],
    "estimator": [{"error_pct": 10.0}],
    "gpu_tests": [{"test": "t::a", "outcome": "passed"}, {"test": "t::b", "outcome": "failed"}],
    "model_step": [
        {"impl": i, "compile": c, "mfu_pct": 20.0, "tokens_per_s": t}
        for c in (False, True) for i, t in (("ours", 100.0), ("transformers", 110.0))
    ],
    "recompute": [{"policy": "selective", "overhead_pct": 9.0}],
}  # fmt: skip


@pytest.mark.parametrize("section", GOAL_SECTIONS)
def test_each_goal_is_missed_where_its_figures_miss_it(section):
    goals = _goals_of(section, MISSED[section])
    measured = [g for g in goals if g["value"] != NOT_MEASURED]
    assert measured and all(g["met"] is False for g in measured), goals


def test_attention_accuracy_is_judged_only_on_rows_that_were_checked():
    rows = [_attention_row("triton", 110.0), _attention_row("sdpa:flash", 100.0)]
    goal = _goals_of("attention", rows)[-1]  # kept rows from before the check
    assert goal["met"] is None and goal["value"] == NOT_MEASURED
    rows[0]["accurate"] = True
    goal = _goals_of("attention", rows)[-1]
    assert goal["met"] is None and goal["value"].endswith("not checked: sdpa:flash")
    rows[1]["accurate"] = True
    assert _goals_of("attention", rows)[-1]["met"] is True
