"""Every private name of an outside library (torch, DeepSpeed, bitsandbytes, Hydra, the
standard library ...) that the code uses, found by reading it with ``ast``; the guard in
tests/test_private_apis.py must list each one. ``python scripts/private_names.py`` prints them.

A name is private when a part of it starts with ``_`` (not a dunder), or when it is reached
through such a part (``torch._functorch.config.patch`` and its keywords). Found:
- imports and attribute chains from an outside module (aliases such as
  ``aten = torch.ops.aten`` and literal ``getattr``/``hasattr``/``setattr`` followed), with
  the keywords passed to a private callable: ``torch._grouped_mm(offs=)``;
- a private attribute of an object the scan cannot trace (``storage._cdata``): ``*._cdata``,
  unless the name is one this repo defines (``self._x = ...``, ``def _x``, an argument ...);
- in a class with an outside base, what it takes from the base through ``self`` or
  ``super()`` and does not define itself (``_CachingTorchDispatchMode.storage``), and a
  private method it defines that none of our code calls: a hook the base calls (any
  method, where the base is private: ``_fsdp_api.AllGather.allocate``);
- string constants naming a private identifier (``"_orig_mod"``, ``"_flash_attn_forward"``)
  that this repo does not define, and every one in a string of op names (``"aten::_x"``):
  attribute, key and op names used through strings;
- assignments to an outside object's attribute (a patch, ``torch.UntypedStorage.resize_``)
  and to any object's ``__class__`` (a swap of an object's class under its library's feet).
Dunders are otherwise public protocol. tests/ is not scanned: a test that uses a private
name fails by itself, by name, when it goes; the guard is for the code that runs.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("llm", "benchmarks", "experiments", "scripts", "train.py")
# The scripts in these folders import each other by file name (``import strategies``).
SCRIPT_DIRS = ("benchmarks", "experiments", "scripts")
SELF = "scripts/private_names.py"  # its strings are the rules' data, not uses
# Named with an underscore but documented as public (os._exit; namedtuple's methods), and
# documented settings assigned to.
DOCUMENTED = {
    "os._exit",
    "*._replace",
    "*._asdict",
    "*._fields",
    "*._make",
    "sys.argv =",
    "torch.backends.cuda.matmul.allow_tf32 =",
    "torch.backends.cudnn.allow_tf32 =",
    "warnings.showwarning =",  # the warnings module documents replacing it
}
# Suffixes of our own config and metric names, matched as strings (``.removesuffix("_gpu")``).
OWN_STRINGS = {"_gpu", "_medium", "_sharded", "_tflops", "_per_layer"}
IDENT = re.compile(r"(?<![\w])(_[A-Za-z0-9]\w*)")


def _dunder(part: str) -> bool:
    return part.startswith("__") and part.endswith("__")


def private(part: str) -> bool:
    return part.startswith("_") and not _dunder(part)


def files(root: Path = REPO) -> list[Path]:
    out = []
    for name in SCANNED:
        path = root / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return [p for p in out if p != root / SELF]


def our_modules(root: Path = REPO) -> set[str]:
    """Top-level names that import this repo's code."""
    scripts = {p.stem for d in SCRIPT_DIRS for p in (root / d).glob("*.py")}
    return {"llm", "benchmarks", "experiments", "scripts", "tests", "train"} | scripts


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _assigned(body: list[ast.stmt]) -> set[str]:
    """The names a module or class body assigns."""
    targets = [t for n in body if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in body if isinstance(n, ast.AnnAssign)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _stored(tree: ast.AST) -> list[ast.Attribute]:
    kind = ast.Attribute
    return [n for n in ast.walk(tree) if isinstance(n, kind) and isinstance(n.ctx, ast.Store)]


def _attributes(tree: ast.Module) -> set[str]:
    """Names this code gives objects: functions and classes (methods, module members), what a
    module or class body assigns, and attributes assigned anywhere (``x._y = ...``)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    defs = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    bodies = [tree, *(n for n in defs if isinstance(n, ast.ClassDef))]
    return (
        {n.name for n in defs}
        | set().union(*(_assigned(b.body) for b in bodies))
        | {n.attr for n in _stored(tree)}
    )


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class defines for its instances: its body's names and ``self.x = ...``."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    on_self = {n.attr for n in _stored(cls) if getattr(n.value, "id", None) == "self"}
    return {n.name for n in cls.body if isinstance(n, kinds)} | _assigned(cls.body) | on_self


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _getattr(node: ast.AST) -> bool:
    """``getattr(x, "name"[, default])`` or ``hasattr(x, "name")``: an attribute use."""
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("getattr", "hasattr")
        and len(node.args) >= 2
        and _literal(node.args[1]) is not None
    )


def _chain(node: ast.AST) -> tuple[ast.AST, list[ast.AST]]:
    """``a.b.c`` as its root and the nodes of its attributes, innermost first."""
    links: list[ast.AST] = []
    while isinstance(node, ast.Attribute) or _getattr(node):
        links.append(node)
        node = node.value if isinstance(node, ast.Attribute) else node.args[0]
    return node, links[::-1]


def _name(link: ast.AST) -> str:
    return link.attr if isinstance(link, ast.Attribute) else link.args[1].value


class _Repo:
    """What the whole scan knows: our modules, the attribute names we define, those we set
    on other objects than ``self`` and every attribute name our code reads."""

    def __init__(self, trees: list[ast.AST], modules: set[str]) -> None:
        self.modules = modules
        self.ours = set().union(*map(_attributes, trees))
        walk = [node for t in trees for node in ast.walk(t)]
        attrs = [node for node in walk if isinstance(node, ast.Attribute)]
        self.read = {n.attr for n in attrs if isinstance(n.ctx, ast.Load)}
        self.read |= {_name(n) for n in walk if _getattr(n)}
        stored = [n for t in trees for n in _stored(t)]
        self.set_on_others = {n.attr for n in stored if getattr(n.value, "id", None) != "self"}


class _File(ast.NodeVisitor):
    def __init__(self, tree: ast.AST, where: str, repo: _Repo) -> None:
        self.where, self.repo = where, repo
        self.found: dict[str, list[str]] = defaultdict(list)
        self.skip = _docstrings(tree)  # and, once read, getattr's names and shorter chains
        self.alias: dict[str, str | None] = {}  # name -> outside dotted path; None: ours
        self.classes: list[tuple[str | None, set[str]]] = []  # (outside base, own names)
        self.value: ast.AST | None = None  # what the assignment being read assigns
        for _ in range(2):  # an alias may be made from another
            self._aliases(tree)

    def add(self, key: str, node: ast.AST) -> None:
        if key not in DOCUMENTED:
            self.found[key].append(f"{self.where}:{node.lineno}")

    def ours(self, module: str | None, level: int = 0) -> bool:
        return bool(level) or (module or "").split(".")[0] in self.repo.modules

    def _aliases(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    bound = None if self.ours(top) else a.name if a.asname else top
                    self.alias[a.asname or top] = bound
            elif isinstance(node, ast.ImportFrom):
                ours = self.ours(node.module, node.level)
                for a in node.names:
                    self.alias[a.asname or a.name] = None if ours else f"{node.module}.{a.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and (path := self.resolve(node.value)):
                    self.alias[target.id] = path

    def resolve(self, node: ast.AST) -> str | None:
        """The outside dotted path ``node`` reaches, if it starts from an outside import."""
        root, links = _chain(node)
        if isinstance(root, ast.Name) and self.alias.get(root.id):
            return ".".join([self.alias[root.id], *map(_name, links)])
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if not self.ours(a.name) and any(map(private, a.name.split("."))):
                self.add(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not self.ours(node.module, node.level):
            for a in node.names:
                path = f"{node.module}.{a.name}"
                if any(map(private, path.split("."))):
                    self.add(path, node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        base = next(filter(None, map(self.resolve, node.bases)), None)
        members = _members(node)
        self.classes.append((base, members))
        # What none of our code reads is a hook its outside base calls: a private method or
        # class attribute, or any (not a dunder) where the base itself is private.
        hooks = bool(base) and any(map(private, base.split(".")))
        for name in sorted(members) if base else ():
            if (private(name) or hooks) and name not in self.repo.read and not _dunder(name):
                self.add(f"{base}.{name}", node)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        self.value = node.value
        for target in node.targets:
            if isinstance(target, ast.Attribute):
                self._chain(target, store=True)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._chain(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _getattr(node):
            self._chain(node)
        elif getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
            attr = _literal(node.args[1])
            if attr and (path := self.resolve(node.args[0])):
                self.skip.add(id(node.args[1]))
                self.add(f"{path}.{attr} =", node)
        path = self.resolve(node.func)
        if path and any(map(private, path.split("."))):
            for kw in node.keywords:
                if kw.arg:
                    self.add(f"{path}({kw.arg}=)", node)
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        # A piece right after a {field} ends a composed word (f"{stage}_memory"), no name.
        for before, piece in zip(node.values, node.values[1:], strict=False):
            m = (
                isinstance(before, ast.FormattedValue)
                and _literal(piece)
                and IDENT.match(piece.value)
            )
            if m:
                self._strings(piece, piece.value[m.end() :])
                self.skip.add(id(piece))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.skip:
            self._strings(node, node.value)

    def _strings(self, node: ast.AST, text: str) -> None:
        ops = "::" in text  # op names ("aten::_softmax"): never ours, whatever we name alike
        for name in IDENT.findall(text):
            if private(name) and (ops or name not in self.repo.ours) and name not in OWN_STRINGS:
                self.add(repr(name), node)

    def _chain(self, node: ast.AST, store: bool = False) -> None:
        if id(node) in self.skip:
            return
        for link in _chain(node)[1]:  # the shorter chains inside are part of this use
            self.skip.add(id(link))
            if not isinstance(link, ast.Attribute):
                self.skip.add(id(link.args[1]))
        self._use(node, store)

    def _use(self, node: ast.AST, store: bool) -> None:
        root, links = _chain(node)
        parts = list(map(_name, links))
        if store and parts[-1] == "__class__":
            self.add(f"*.__class__ = {ast.unparse(self.value)}", node)
        elif path := self.resolve(node):
            if store:  # a patch of an outside object
                self.add(f"{path} =", node)
            elif any(map(private, path.split("."))):
                self.add(path, node)
        elif store:  # on an object of ours, or one we cannot trace: our attribute
            return
        elif base := self._inherited(root, parts[0]):
            if private(base.rsplit(".", 1)[-1]) or private(parts[0]):
                self.add(".".join([base, *parts]), node)
        else:
            first = next((i for i, p in enumerate(parts) if private(p)), None)
            if first is not None and parts[first] not in self.repo.ours:
                self.add(".".join(["*", *parts[first:]]), node)

    def _inherited(self, root: ast.AST, attr: str) -> str | None:
        """The outside base of the enclosing class, where ``self.attr`` or ``super().attr``
        is the base's: not defined by the class, nor set on it from outside."""
        base, own = self.classes[-1] if self.classes else (None, set())
        if base is None:
            return None
        if isinstance(root, ast.Call) and getattr(root.func, "id", None) == "super":
            return base
        mine = attr in own or attr in self.repo.set_on_others
        return base if getattr(root, "id", None) == "self" and not mine else None


def scan(paths: list[Path] | None = None, root: Path = REPO) -> dict[str, list[str]]:
    """Each private name -> where it is used (``path:line``)."""
    paths = files(root) if paths is None else paths
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    repo = _Repo(list(trees.values()), our_modules(root))
    found: dict[str, list[str]] = defaultdict(list)
    for path, tree in trees.items():
        where = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        visitor = _File(tree, where, repo)
        visitor.visit(tree)
        for key, places in visitor.found.items():
            found[key] += places
    return dict(sorted(found.items()))


if __name__ == "__main__":
    for key, places in scan().items():
        print(f"{key}  ({', '.join(places)})")
