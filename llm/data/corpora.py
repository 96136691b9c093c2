"""Corpora: named sources of documents (str), each split into "train" and "val".

A corpus also has a ``digest``: a stable string that changes whenever its documents could
change (files, their sizes and times, the split fraction), so tokenizers and token caches
built from it can be keyed by it and reused across runs and ranks.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from llm.config import DataConfig
from llm.errors import ConfigError

SPLITS = ("train", "val")


class Corpus(Protocol):
    name: str

    @property
    def digest(self) -> str: ...

    def documents(self, split: str) -> Iterator[str]: ...


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` alone (Python's hash() is salted per process)."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def val_keys(keys: Sequence[str], val_fraction: float) -> set[str]:
    """The keys held out for validation: those whose stable fraction is below val_fraction,
    so each key's split never depends on the others. Small corpora could get no val key (or
    no train key) that way; then the lowest (highest) key moves over, so both splits exist."""
    ranked = sorted(keys, key=stable_fraction)
    held = {k for k in ranked if stable_fraction(k) < val_fraction}
    if len(ranked) >= 2 and not held:
        held = {ranked[0]}
    if len(ranked) >= 2 and len(held) == len(ranked):
        held.discard(ranked[-1])
    return held


def split_by_key(files: list[Path], keys: list[str], val_fraction: float) -> dict[str, list[Path]]:
    """Files split into train / val by their stable keys (relative paths), keeping order."""
    held = val_keys(keys, val_fraction)
    return {
        "train": [f for f, k in zip(files, keys, strict=True) if k not in held],
        "val": [f for f, k in zip(files, keys, strict=True) if k in held],
    }


def digest_of(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()


def file_stats(root: Path, files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime) per file: cheap to compute, and changes when a file does."""
    out = []
    for f in files:
        st = f.stat()
        out.append((f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return out


def read_text(path: Path) -> str:
    # A few stdlib test files hold deliberately invalid UTF-8; replacing keeps them usable.
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files, without any installed third-party packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned, not filtered: site-packages can hold several times the stdlib's files.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


class StdlibCorpus:
    """The running Python's standard library sources: every machine has them, no download."""

    name = "stdlib"

    def __init__(self, val_fraction: float) -> None:
        self.root = Path(sysconfig.get_paths()["stdlib"])
        self.files = stdlib_files(self.root)
        rel = [f.relative_to(self.root).as_posix() for f in self.files]
        self.split_files = split_by_key(self.files, rel, val_fraction)
        self._digest = digest_of(self.name, val_fraction, file_stats(self.root, self.files))

    @property
    def digest(self) -> str:
        return self._digest

    def documents(self, split: str) -> Iterator[str]:
        for f in self.split_files[split]:
            yield read_text(f)


def build_corpus(cfg: DataConfig) -> Corpus:
    if cfg.name == "stdlib":
        return StdlibCorpus(cfg.val_fraction)
    if cfg.name == "files":
        from llm.data.files import FilesCorpus

        return FilesCorpus(cfg.path or "", cfg.text_field, cfg.val_fraction)
    from llm.data.wikitext import WikitextCorpus

    return WikitextCorpus(cfg.name, cfg.hub_id, cfg.text_field)


def cache_root(cfg: DataConfig) -> Path:
    if "${" in cfg.cache_dir:
        # DataConfig() built in code keeps the YAML interpolation text of its default.
        raise ConfigError(
            f"data.cache_dir={cfg.cache_dir!r} is unresolved; pass a resolved config "
            "(llm.config.to_dataclass) or set data.cache_dir=PATH"
        )
    return Path(cfg.cache_dir).expanduser()
