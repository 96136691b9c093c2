"""Corpora: named sources of documents (str), each split into "train" and "val".

A corpus also has a ``digest``: a stable string that changes whenever its documents could
change (files, their sizes and times, the split fraction), so tokenizers and token caches
built from it can be keyed by it and reused across runs and ranks.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from llm.config import DataConfig
from llm.data.files import FilesCorpus
from llm.data.sources import digest_of, file_stats, read_text, split_by_key
from llm.data.wikitext import WikitextCorpus
from llm.errors import ConfigError


class Corpus(Protocol):
    name: str

    @property
    def digest(self) -> str: ...

    def documents(self, split: str) -> Iterator[str]: ...


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
        return FilesCorpus(cfg.path or "", cfg.text_field, cfg.val_fraction)
    return WikitextCorpus(cfg.name, cfg.hub_id, cfg.text_field)


def cache_root(cfg: DataConfig) -> Path:
    if "${" in cfg.cache_dir:
        # DataConfig() built in code keeps the YAML interpolation text of its default.
        raise ConfigError(
            f"data.cache_dir={cfg.cache_dir!r} is unresolved; pass a resolved config "
            "(llm.config.to_dataclass) or set data.cache_dir=PATH"
        )
    return Path(cfg.cache_dir).expanduser()
