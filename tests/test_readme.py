"""Every `python train.py ...` command in README.md's bash blocks runs (a few steps on a tiny
model), so the README cannot drift from the code. The command's own arguments are kept (its
strategy, precision, ranks, sweep); overrides appended after them shrink the run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHONS = ("python", ".venv/bin/python")

# Commands that cannot run on this machine, and why (matched as substrings).
NEEDS = {
    "hydra/launcher=submitit_slurm": "submits to a Slurm cluster",
}


def readme_commands() -> list[str]:
    """The train.py command lines of README.md's bash blocks, continuations joined."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if len(words) > 1 and words[0] in PYTHONS and words[1] == "train.py":
                commands.append(shlex.join(words[2:]))
    return commands


def _ranks(args: list[str]) -> int:
    counts = [int(a.split("=", 1)[1]) for a in args if a.startswith("launcher.nproc_per_node=")]
    return max(counts, default=1)


def _cases():
    for command in readme_commands():
        args = shlex.split(command)
        marks = []
        reason = next((why for key, why in NEEDS.items() if key in command), None)
        if reason:
            marks.append(pytest.mark.skip(reason=reason))
        if "-m" in args or _ranks(args) > 1 or any(a.startswith("layout=") for a in args):
            marks.append(pytest.mark.slow)  # several processes: keeps the file near 3 minutes
        elif args and not any(a.startswith("parallelism=zero2") for a in args):
            # The default suite runs the README's first command and its zero2 example; each
            # other one is a training process of 10-30 s on 2 cores, and runs in the slow suite.
            marks.append(pytest.mark.slow)
        yield pytest.param(args, marks=marks, id=command or "(defaults)")


# Models small enough to run as the README names them; any other runs as gpt2-tiny.
SMALL_MODELS = ("gpt2-tiny", "gpt2-mini", "llama-tiny", "moe-tiny")


def _named_model(args: list[str]) -> str | None:
    """The model a command names: model=..., or the one its layout=... sets."""
    named = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), None)
    layout = next((a.split("=", 1)[1] for a in args if a.startswith("layout=")), None)
    if named is None and layout is not None:
        text = (REPO / "conf" / "layout" / f"{layout}.yaml").read_text()
        named = next(iter(re.findall(r"override /model: (\S+)", text)), None)
    return named


def tiny(tmp_path: Path, corpus: Path, cache: Path, args: list[str]) -> list[str]:
    """Overrides that make any README run a few seconds long; warmup stays the default."""
    where = f"hydra.sweep.dir={tmp_path}" if "-m" in args else f"hydra.run.dir={tmp_path}"
    named = _named_model(args)
    return [
        where,
        f"model={named if named in SMALL_MODELS else 'gpt2-tiny'}",
        "data=files",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "data.tokenizer=byte",
        "data.seq_len=64",
        "data.val_samples=8",
        "train.device=cpu",
        "train.max_steps=2",
        "train.micro_batch_size=4",
        "train.eval_every=1000",
        "logger=none",
        "logger.progress=false",
    ]


def test_readme_has_train_commands():
    commands = readme_commands()
    assert "" in commands and "experiment=quick" in commands and len(commands) >= 10


def _on_this_machine(arg: str, tmp_path: Path) -> str:
    """The README's ``parallelism.nvme_path`` names the reader's NVMe mount (the run refuses
    a folder that does not exist); here it is a folder of the test's own."""
    if arg.startswith("parallelism.nvme_path="):
        folder = tmp_path / "nvme"
        folder.mkdir(exist_ok=True)
        return f"parallelism.nvme_path={folder}"
    return arg


@pytest.mark.parametrize("args", list(_cases()))
def test_readme_command_runs(tmp_path, text_corpus, cache_dir, args):
    cmd = [sys.executable, "train.py", *(_on_this_machine(a, tmp_path) for a in args)]
    if "--cfg" not in args:
        cmd += tiny(tmp_path / "out", text_corpus, cache_dir, args)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if "--cfg" in args:
        assert "parallelism:" in result.stdout
        return
    summaries = list((tmp_path / "out").rglob("summary.json"))
    assert summaries, "no summary.json written"
    named = _named_model(args)
    if named in SMALL_MODELS:  # the README's small model ran, not the stand-in
        assert all(json.loads(s.read_text())["model"] == named for s in summaries)
    if not args:
        # The default warmup (30 steps) does not fit 2 steps: clamped, and the log says so.
        # (The console wraps long lines: compare with whitespace collapsed.)
        output = " ".join((result.stdout + result.stderr).split())
        assert "warming up for 0 steps" in output
