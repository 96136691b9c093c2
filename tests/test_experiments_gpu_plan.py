"""`python -m experiments list --gpu` (experiments/gpu_plan.py): its commands name every
part of every GPU config, the multi-GPU experiments say their GPU counts, a printed command
composes through the runner's own argument split and config path, and committed records
are counted and resumed from. Nothing trains."""

from __future__ import annotations

import json
import re
import shlex
from contextlib import redirect_stdout
from io import StringIO

import pytest

from experiments import gpu_plan, records
from experiments.__main__ import _parser, main, split_args
from experiments.parts import FOLLOW_UPS, gpus_needed, part_overrides, parts_of
from experiments.report import EXPERIMENTS
from experiments.resume import refuse_too_few_gpus
from experiments.runner import REPO, compose_jobs, config_name, expand, sweep_jobs, sweep_params
from llm.config import to_dataclass
from llm.errors import ConfigError
from llm.validate import validate


@pytest.fixture(scope="module")
def listing() -> str:
    out = StringIO()
    with redirect_stdout(out):
        assert main(["list", "--gpu"]) == 0
    return out.getvalue()


def commands_of(listing: str, name: str) -> list[str]:
    return re.findall(rf"^ +(python -m experiments run {name} .*)$", listing, re.M)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_listing_names_every_part_of_the_config(listing, name):
    config = config_name(name, "gpu")
    printed = [split_args(shlex.split(c)[4:])[1] for c in commands_of(listing, name)]
    parts = list(parts_of(config))
    assert [p for p in printed if p != "follow_ups"] == (parts or [None])
    for c in commands_of(listing, name):
        assert f"--out docs/experiments/{config}" in c


def test_multi_gpu_experiments_list_their_gpu_counts(listing):
    for name in ("zero_memory", "parallel_strategies"):
        counts = gpus_needed(config_name(name, "gpu"))
        assert counts, f"{name}_gpu.yaml names no GPU count"
        head = next(ln for ln in listing.splitlines() if ln.startswith(f"{name} "))
        assert f"needs {' or '.join(map(str, counts))} GPUs" in head
    zero = "\n".join(gpu_plan.lines("zero_memory"))
    assert "part ranks4, 4 GPUs:" in zero and "part ranks8, 8 GPUs:" in zero


def test_a_part_needs_its_own_gpu_count_and_the_refusal_gives_the_commands():
    refuse_too_few_gpus("zero_memory_gpu", part_overrides("zero_memory_gpu", "ranks4"), have=4)
    with pytest.raises(ConfigError) as refused:
        refuse_too_few_gpus("zero_memory_gpu", part_overrides("zero_memory_gpu", "ranks8"), have=4)
    message = str(refused.value)
    assert "\n" not in message
    for n, cmds in gpu_plan.multi_gpu_commands("zero_memory").items():
        assert f"on {n} GPUs: {cmds}" in message
    assert "part=ranks8" in gpu_plan.multi_gpu_commands("zero_memory")[8]
    assert "part=ranks8" not in gpu_plan.multi_gpu_commands("zero_memory")[4]


@pytest.mark.parametrize("name", ["zero_memory", "parallel_strategies", "flash_attention"])
def test_a_printed_command_composes(listing, name):
    """The first printed command, parsed by the runner's own parser and argument split,
    composes its part's first job; a multi-GPU one also validates with its rank count."""
    argv = shlex.split(commands_of(listing, name)[0])[3:]
    a = _parser().parse_args(argv)
    scale, part, overrides = split_args(a.overrides)
    config = config_name(a.name, scale)
    jobs = sweep_jobs(config, [*overrides, *part_overrides(config, part)])
    assert jobs
    (composed,) = compose_jobs(config, jobs[:1])
    cfg = to_dataclass(composed)
    if gpus_needed(config):
        assert cfg.launcher.nproc_per_node == gpu_plan.steps(name)[0].gpus
        validate(cfg)


def test_committed_records_are_counted_and_resumed_from(tmp_path):
    config = "flash_attention_gpu"
    assert "--resume" not in gpu_plan.steps("flash_attention", docs=tmp_path)[0].command
    folder = tmp_path / config
    jobs = [["attention=eager", "data.seq_len=1024"], ["attention=sdpa", "data.seq_len=1024"]]
    plan = {"config": config, "jobs": jobs, "parts": {"1": [0, 1]}, "follow_ups": {}}
    folder.mkdir()
    (folder / records.PLAN).write_text(json.dumps({**plan, "follow_ups_done": True}))
    (folder / "0").mkdir()
    (folder / "0" / records.RECORD).write_text(json.dumps({"job": jobs[0], "failed": False}))
    assert "1 of 2 planned jobs recorded" in gpu_plan.recorded(config, docs=tmp_path)
    command = gpu_plan.steps("flash_attention", docs=tmp_path)[0].command
    assert command.endswith(f"--out docs/experiments/{config} --resume docs/experiments/{config}")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_docs_gpu_report_line_says_what_to_run(name):
    """docs/experiments.md: each experiment's "GPU report" paragraph gives its reason and the
    command into the records folder, naming every part, as the listing does."""
    text = (REPO / "docs" / "experiments.md").read_text()
    section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
    report = " ".join(section.split("GPU report: ", 1)[1].split("\n\n", 1)[0].split())
    config = config_name(name, "gpu")
    assert report.startswith("pending, ")
    assert "scale=gpu" in report and f"logger=none --out docs/experiments/{config}" in report
    assert f"--resume docs/experiments/{config}" in report
    for part in parts_of(config):
        assert re.search(rf"(part=|P = |, | and ){part}\b", report), f"{name}: part {part}"


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if parts_of(config_name(n, "gpu"))])
def test_the_listed_parts_cover_every_job_of_the_sweep(name):
    """Running each listed part runs the whole sweep: no job sits outside every part (an
    experiment without parts lists the whole sweep)."""
    config = config_name(name, "gpu")
    params = sweep_params(config)
    every = {records.identity(j) for j in expand(params)}
    covered = set()
    for step in gpu_plan.steps(name):
        if step.part != FOLLOW_UPS:
            covered |= {
                records.identity(j) for j in expand(params, part_overrides(config, step.part))
            }
    assert covered == every
