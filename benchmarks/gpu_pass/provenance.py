"""Which commit a GPU pass ran from, and which files each section's figures depend on.

The tree: its commit and whether it had changes, from ``git`` where the checkout has it;
else from the stamp ``.gpu_pass_commit`` that ``python -m benchmarks.gpu_pass.provenance``
(``make gpu-stamp``) writes before the tree is copied to a machine without ``.git``: the
commit, the dirty flag and the sha256 of every file git lists (tracked, and untracked but
not ignored). A stamp any of whose files changed since is refused; with neither, the commit
and the flag are None (unknown), never a guess.

A section: the repository files its process imported (``sys.modules``, written by the
section's process to GPU_PASS_DEPS_JSON) and the files it reads as data (``Section.data``),
each with its sha256, and one digest over them all. ``--resume`` keeps an earlier call's
rows only where that digest is unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAMP_NAME = ".gpu_pass_commit"
DEPS_ENV = "GPU_PASS_DEPS_JSON"
UNKNOWN_NOTE = "recorded before records named their commit"


def file_hash(path: Path) -> str | None:
    """sha256 of the file's bytes; None where it is missing."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def hashes(paths: list[str], root: Path = REPO) -> dict[str, str | None]:
    return {p: file_hash(root / p) for p in sorted(set(paths))}


def digest(files: dict[str, str | None]) -> str:
    """One sha256 over every (path, content hash) pair: a changed, added or removed file
    changes it."""
    text = "".join(f"{path}\0{files[path]}\n" for path in sorted(files))
    return hashlib.sha256(text.encode()).hexdigest()


def _in_repo(path: str | None, root: Path) -> str | None:
    """``path`` relative to the repository, or None outside it, in a dot folder (.venv,
    .cache), in installed packages, or not absolute (torch's ``_ops.py``: no file)."""
    if not path or not os.path.isabs(path):
        return None
    try:
        rel = Path(path).resolve().relative_to(root)
    except ValueError:
        return None
    if any(part.startswith(".") or part == "site-packages" for part in rel.parts):
        return None
    return rel.as_posix()


def module_files(root: Path = REPO) -> list[str]:
    """The repository's files among this process's imported modules."""
    found = (_in_repo(getattr(m, "__file__", None), root) for m in list(sys.modules.values()))
    return sorted({f for f in found if f})


def write_module_files() -> None:
    """The section's process: its imported repository files where the runner reads them
    (GPU_PASS_DEPS_JSON); a no-op outside the runner. Written again as the section goes,
    so a section cut short still names what it had imported."""
    path = os.environ.get(DEPS_ENV)
    if path:
        Path(f"{path}.tmp").write_text(json.dumps(module_files()))
        os.replace(f"{path}.tmp", path)


def data_files(patterns: tuple[str, ...], root: Path = REPO) -> list[str]:
    """The files under ``root`` that the glob ``patterns`` match."""
    found = (_in_repo(str(p), root) for pattern in patterns for p in root.glob(pattern))
    return sorted({f for f in found if f and (root / f).is_file()})


def section_files(modules: list[str], patterns: tuple[str, ...], root: Path = REPO) -> dict:
    """A section's entry: ``digest`` and ``files`` (path: sha256)."""
    files = hashes(modules + data_files(patterns, root), root)
    return {"digest": digest(files), "files": files}


def changed_since(entry: dict, root: Path = REPO) -> str | None:
    """Why an earlier record's section entry no longer holds for this tree, or None where
    every file it depended on is unchanged."""
    earlier = entry.get("provenance") or {}
    if not earlier.get("digest"):
        return f"its record names no digest ({UNKNOWN_NOTE})"
    now = hashes(list(earlier["files"]), root)
    if digest(now) == earlier["digest"]:
        return None
    changed = [p for p in now if now[p] != earlier["files"][p]]
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"its files changed since: {', '.join(changed[:3])}{more}"


def _git(*args: str, root: Path = REPO) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass
class Tree:
    """The commit a run starts from: ``sha`` and ``dirty`` None where unknown; ``source``
    says how they are known; ``stamped`` the stamp's files (None from git)."""

    sha: str | None
    dirty: bool | None
    source: str | None
    stamped: set[str] | None = None

    def record(self) -> dict:
        out = {"sha": self.sha, "dirty": self.dirty, "source": self.source}
        return out if self.sha else {**out, "note": "no git and no stamp where it ran"}


def _excluded(root: Path, skip: list[Path]) -> list[str]:
    """Pathspecs leaving out the stamp and the folders the pass writes to."""
    specs = [f":(exclude){STAMP_NAME}"]
    for path in skip:
        rel = _in_repo(str(path), root)
        if rel:
            specs.append(f":(exclude){rel}")
    return specs


def from_git(root: Path = REPO, skip: tuple[Path, ...] = ()) -> Tree | None:
    """The checkout's HEAD and status; None where ``root`` is not a git checkout's top (a
    copy without ``.git``, even inside another repository)."""
    head = (_git("rev-parse", "--show-toplevel", "HEAD", root=root) or "").splitlines()
    if len(head) != 2 or Path(head[0]).resolve() != root.resolve():
        return None
    status = _git("status", "--porcelain", "--", ".", *_excluded(root, list(skip)), root=root)
    dirty = None if status is None else bool(status.strip())
    return Tree(head[1], dirty, "git")


def tracked_files(root: Path = REPO) -> list[str]:
    """What git lists (tracked, and untracked but not ignored) less the stamp: the files
    that travel with a copy of the working tree."""
    listed = _git("ls-files", "-co", "--exclude-standard", "-z", root=root) or ""
    return sorted({p for p in listed.split("\0") if p and p != STAMP_NAME})


def _stamp_and_changes(root: Path) -> tuple[dict, list[str]] | None:
    path = root / STAMP_NAME
    if not path.exists():
        return None
    stamp = json.loads(path.read_text())
    return stamp, [p for p, h in stamp["files"].items() if file_hash(root / p) != h]


def _stamp_tree(stamp: dict) -> Tree:
    return Tree(stamp["sha"], stamp["dirty"], STAMP_NAME, set(stamp["files"]))


def from_stamp(root: Path = REPO) -> Tree | None:
    found = _stamp_and_changes(root)
    if found is None:
        return None
    stamp, changed = found
    if changed:
        raise SystemExit(
            f"{STAMP_NAME}: {len(changed)} files changed since it was written (first: "
            f"{changed[0]}); write it again (make gpu-stamp) from the tree that travels"
        )
    return _stamp_tree(stamp)


def current(root: Path = REPO, skip: tuple[Path, ...] = ()) -> Tree:
    """git where it says the tree is clean; else a stamp every file of which is as stamped
    (a copy can carry a stale ``.git`` beside the stamp written for it: the device copy of
    2026-11-28 had HEAD one commit behind, so git called the stamped tree dirty); else git;
    else the stamp (refused where its files changed); else unknown."""
    git = from_git(root, skip)
    if git is not None and git.dirty is False:
        return git
    found = _stamp_and_changes(root)
    if found is not None and not found[1]:
        return _stamp_tree(found[0])
    return git or from_stamp(root) or Tree(None, None, None)


def stamp(root: Path = REPO) -> dict:
    """Write ``.gpu_pass_commit`` from git: the commit, the dirty flag, every file's hash."""
    tree = from_git(root)
    if tree is None:
        raise SystemExit("make gpu-stamp needs git: run it in the checkout, before the copy")
    files = {p: h for p, h in hashes(tracked_files(root), root).items() if h is not None}
    out = {"sha": tree.sha, "dirty": tree.dirty, "files": files}
    (root / STAMP_NAME).write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    out = stamp()
    state = "with uncommitted changes" if out["dirty"] else "clean"
    print(f"wrote {STAMP_NAME}: {out['sha']} ({state}), {len(out['files'])} files")


if __name__ == "__main__":
    main()
