"""Shared fixtures: no network, offline W&B, caches in tmp, and a small real-text corpus."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Set before any test imports transformers / datasets / wandb.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """A folder of real text documents of different lengths (standard-library modules)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [
        "textwrap.py",
        "shlex.py",
        "fnmatch.py",
        "glob.py",
        "bisect.py",
        "heapq.py",
        "colorsys.py",
        "keyword.py",
        "stat.py",
        "this.py",
        "base64.py",
        "string.py",
        "copy.py",
        "queue.py",
        "sched.py",
        "numbers.py",
        "operator.py",
        "linecache.py",
    ]
    for name in names:
        (root / f"{Path(name).stem}.txt").write_text((stdlib / name).read_text())
    return root


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llm_cache")


@pytest.fixture(scope="session")
def line_docs(tmp_path_factory, text_corpus) -> Path:
    """A jsonl corpus whose documents are single source lines: many different lengths."""
    import json

    root = tmp_path_factory.mktemp("lines")
    lines = [
        line
        for path in sorted(text_corpus.glob("*.txt"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    with open(root / "lines.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    return root / "lines.jsonl"
