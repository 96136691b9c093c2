"""Modules that find the repository from their own file: a move between rooms changes how
far up the root is (the 2026-11-28 move left the config groups and the cache folders
looking under llm/, and `train.py experiment=quick` was refused)."""

from __future__ import annotations

from llm.launch import launcher
from llm.runfiles import preflight


def test_the_launcher_and_the_preflight_name_the_repository_root():
    assert (launcher.REPO / "train.py").is_file()
    assert (preflight.CONF / "config.yaml").is_file()
    assert (preflight.CONF / "experiment").is_dir()
