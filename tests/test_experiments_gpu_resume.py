"""Recorded GPU-scale runs that continue across short runs (experiments/resume.py,
experiments/records.py): only the missing jobs run, a record whose code differs is refused,
one whose code matches is kept, the report withholds verdicts until a claim's jobs are in,
and records from a dirty tree are not published. The jobs are stand-ins (no training)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from benchmarks.gpu_pass import provenance
from experiments import records
from experiments.parts import parts_of
from experiments.report import publish, write_report
from experiments.resume import refuse_too_few_gpus, run_recorded
from llm.errors import ConfigError

CONFIG = "flash_attention_gpu"  # 16 jobs in two parts of 8 (its '# part' lines)
# eager 4T², the flash kernels 819.2T: 10x at T = 2048, 20x at 4096, as the papers state
FLASH_BYTES = {"eager": lambda t: 4.0 * t * t, "sdpa": lambda t: 819.2 * t}


class FakeJobs:
    """A job runner writing what a finished flash_attention job writes: its overrides, the
    composed values the report reads, and a summary with attention's saved bytes."""

    def __init__(self, root: Path) -> None:
        self.root, self.ran = root, []

    def __call__(self, config: str, job: list[str], scratch: Path) -> Path:
        self.ran.append(sorted(job))
        values = dict(o.split("=", 1) for o in job)
        job_dir = self.root / f"job{len(self.ran)}"
        (job_dir / ".hydra").mkdir(parents=True)
        (job_dir / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump([f"experiment={config}", *job])
        )
        backend, t = values["attention"], int(values["data.seq_len"])
        config_yaml = {"attention": {"backend": backend}, "data": {"seq_len": t}}
        (job_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config_yaml))
        saved = FLASH_BYTES.get(backend, FLASH_BYTES["sdpa"])(t)
        summary = {
            "device": "cpu",
            "hardware": {"cpu": "stand-in", "cpu_count": 1},
            "final_train_loss": 1.0,
            "memory_peak": [{"activations_attention": saved}],
        }
        (job_dir / "summary.json").write_text(json.dumps(summary))
        return job_dir


@pytest.fixture(autouse=True)
def steady_code(monkeypatch):
    """Records name one config file as their code: other work in this checkout edits llm/
    while the tests run, and a changed file is refused (as the tests check on purpose)."""
    monkeypatch.setattr(
        records, "code_files", lambda config, choices: [f"conf/experiment/{config}.yaml"]
    )


@pytest.fixture
def fake(tmp_path):
    return FakeJobs(tmp_path / "runs")


def _record(out: Path, num: str) -> dict:
    return json.loads((out / num / records.RECORD).read_text())


def _rewrite(out: Path, num: str, change) -> None:
    record = _record(out, num)
    change(record)
    (out / num / records.RECORD).write_text(json.dumps(record))


def test_parts_split_the_sweep():
    parts = parts_of(CONFIG)
    assert parts == {"1": ["data.seq_len=1024,2048"], "2": ["data.seq_len=4096,8192"]}


def test_resume_runs_only_the_missing_jobs_and_withholds_verdicts(tmp_path, fake):
    out = tmp_path / "flash_attention_gpu"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    assert len(fake.ran) == 8
    assert {o for job in fake.ran for o in job if o.startswith("data.seq_len")} == {
        "data.seq_len=1024",
        "data.seq_len=2048",
    }
    text = write_report(out, log_wandb=False).read_text()
    assert "Jobs recorded: 8 of 16 planned" in text
    assert "not enough jobs yet (8 of 16)" in text  # the growth claims need both parts
    saving_2k = [ln for ln in text.splitlines() if ln.startswith("| saving_2k | eager / sdpa")]
    assert saving_2k and "| holds |" in saving_2k[0]  # part 1 is all saving_2k needs
    first = list(fake.ran)

    run_recorded(CONFIG, [], out, resume=out, run_job=fake)
    rest = fake.ran[len(first) :]
    assert len(rest) == 8 and not {tuple(j) for j in rest} & {tuple(j) for j in first}
    text = write_report(out, log_wandb=False).read_text()
    assert not re.search(rf"{records.NOT_ENOUGH} \(\d", text)  # every verdict given

    run_recorded(CONFIG, [], out, resume=out, run_job=fake)
    assert len(fake.ran) == 16  # nothing was missing


def test_resume_into_another_folder_keeps_the_earlier_records(tmp_path, fake):
    earlier, out = tmp_path / "docs_copy", tmp_path / "out"
    run_recorded(CONFIG, [], earlier, part="1", run_job=fake)
    run_recorded(CONFIG, [], out, resume=earlier, part="2", run_job=fake)
    assert len(fake.ran) == 16
    assert len(records.job_dirs(out)) == 16 and len(records.job_dirs(earlier)) == 8


def test_a_record_whose_code_differs_is_refused_naming_job_and_file(tmp_path, fake):
    out = tmp_path / "out"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    changed = sorted(_record(out, "0")["provenance"]["files"])[0]

    def other_commit_other_code(record):
        record["commit"]["sha"] = "f" * 40
        files = {**record["provenance"]["files"], changed: "0" * 64}
        record["provenance"] = {"digest": provenance.digest(files), "files": files}

    _rewrite(out, "0", other_commit_other_code)
    with pytest.raises(ConfigError, match=rf"^0 \(attention=eager.*{changed}"):
        run_recorded(CONFIG, [], out, resume=out, part="2", run_job=fake)
    assert len(fake.ran) == 8  # refused before any job ran


def test_a_record_at_another_commit_with_the_same_code_is_kept(tmp_path, fake):
    out = tmp_path / "out"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    _rewrite(out, "0", lambda r: r["commit"].update(sha="f" * 40))
    run_recorded(CONFIG, [], out, resume=out, part="1", run_job=fake)
    assert len(fake.ran) == 8  # job 0 was not run again


def test_a_failed_job_runs_again(tmp_path, fake):
    out = tmp_path / "out"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    _rewrite(out, "4", lambda r: r.update(failed=True))
    run_recorded(CONFIG, [], out, resume=out, part="1", run_job=fake)
    assert len(fake.ran) == 9


def test_records_from_a_dirty_tree_are_not_published(tmp_path, fake):
    out, docs = tmp_path / "out", tmp_path / "docs"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    write_report(out, log_wandb=False)
    for d in records.job_dirs(out):
        _rewrite(out, d.name, lambda r: r["commit"].update(sha="a" * 40, dirty=False))
    _rewrite(out, "5", lambda r: r["commit"].update(dirty=True))
    with pytest.raises(ConfigError, match="5 was recorded from a tree with uncommitted changes"):
        publish(out, docs)
    _rewrite(out, "5", lambda r: r["commit"].update(dirty=False))
    published = publish(out, docs)
    assert published == docs / CONFIG / "report.md" and published.exists()
    assert len(records.job_dirs(docs / CONFIG)) == 8


def test_bad_input_is_refused_in_one_line(tmp_path, fake):
    with pytest.raises(ConfigError, match="has no part 9; its parts: 1, 2, follow_ups"):
        run_recorded(CONFIG, [], tmp_path / "a", part="9", run_job=fake)
    with pytest.raises(ConfigError, match=r"no plan\.json there"):
        run_recorded(CONFIG, [], tmp_path / "b", resume=tmp_path / "empty", run_job=fake)
    out = tmp_path / "c"
    run_recorded(CONFIG, [], out, part="1", run_job=fake)
    with pytest.raises(ConfigError, match="holds records of another sweep"):
        run_recorded(CONFIG, ["attention=eager"], out, resume=out, run_job=fake)
    with pytest.raises(ConfigError, match="run the parts first"):
        run_recorded(CONFIG, [], out, resume=out, part="follow_ups", run_job=fake)


def test_multi_gpu_experiments_are_refused_on_fewer_gpus():
    with pytest.raises(ConfigError, match=r"needs 8 GPUs .* this machine has 1; on 4 GPUs"):
        refuse_too_few_gpus("zero_memory_gpu", [], have=1)
    with pytest.raises(ConfigError, match="needs 4 GPUs"):
        refuse_too_few_gpus("parallel_strategies_gpu", ["launcher.nproc_per_node=4"], have=2)
    refuse_too_few_gpus("zero_memory_gpu", ["launcher.nproc_per_node=4"], have=4)
    refuse_too_few_gpus(CONFIG, [], have=0)  # one GPU or none: nothing to refuse
