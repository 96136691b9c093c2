"""The house's rules that a move can quietly break (docs/design.md's map): few loose modules
at the top of llm/, every room says what it holds, and run._train stays a short list of
named steps. Read with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLM = REPO / "llm"


def test_at_most_six_modules_stand_at_the_top_of_llm():
    loose = sorted(p.name for p in LLM.glob("*.py"))
    assert len(loose) <= 6, f"llm/ holds {loose}: give the new ones a room"


def test_every_room_says_what_it_holds():
    rooms = [p.parent for p in LLM.glob("*/__init__.py")]
    assert rooms
    silent = [
        room.name
        for room in rooms
        if not ast.get_docstring(ast.parse((room / "__init__.py").read_text()))
    ]
    assert not silent, f"rooms whose __init__ has no docstring: {silent}"


def test_run_train_is_under_sixty_lines():
    tree = ast.parse((LLM / "run.py").read_text())
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_train"]
    length = train.end_lineno - train.lineno + 1
    assert length < 60, f"run._train is {length} lines: move a step into a named function"
