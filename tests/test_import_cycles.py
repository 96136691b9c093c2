"""No import circle among the modules of llm/ or of benchmarks/, nor between their rooms
(each top-level module or subpackage). Every import is read with ``ast``, nothing is
imported: a function-level import ties two modules as much as a top-level one. A package's
``__init__`` re-exporting its own modules is no circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# benchmarks/ scripts import their siblings by bare name (the script's folder is on sys.path).
BARE_SIBLINGS = {"llm": False, "benchmarks": True}


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (REPO / package).rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, name: str, is_init: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = (name if is_init else name.rpartition(".")[0]).split(".")
        base = ".".join([*package[: len(package) - (node.level - 1)], *([base] if base else [])])
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    siblings = {m.split(".")[1] for m in modules if "." in m} if BARE_SIBLINGS[package] else set()
    graph = {}
    for name, path in modules.items():
        is_init = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target in _targets(node, name, is_init):
                if target.split(".")[0] in siblings:
                    target = f"{package}.{target}"
                while target and target not in modules:  # the module the import lies inside
                    target = target.rpartition(".")[0]
                if target and target != name and not (is_init and target.startswith(name + ".")):
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                out.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    def room(m: str) -> str:
        return ".".join(m.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for a, targets in graph.items():
        rooms.setdefault(room(a), set()).update(room(b) for b in targets if room(b) != room(a))
    return rooms


@pytest.mark.parametrize("package", list(BARE_SIBLINGS))
def test_no_module_imports_itself_through_others(package):
    assert _cycles(_graph(package)) == []


@pytest.mark.parametrize("package", list(BARE_SIBLINGS))
def test_no_room_imports_upward(package):
    assert _cycles(_rooms(_graph(package))) == []


def test_the_walk_sees_a_circle_through_bare_sibling_imports(tmp_path, monkeypatch):
    """The check itself: two scripts importing each other by bare name, one lazily."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setitem(BARE_SIBLINGS, "pkg", True)
    assert _cycles(_graph("pkg")) == [["pkg.a", "pkg.b"]]
