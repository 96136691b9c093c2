"""data=files: your own text, from a file, a folder (recursive) or a glob.

.txt/.md/.py files are one document each; .jsonl files hold one document per line (the
text under data.text_field); .parquet files one per row (the data.text_field column).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path

from llm.data.sources import digest_of, file_stats, read_text, split_by_key, val_keys
from llm.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
# Undecodable characters a text file may hold: a stray byte passes, a binary file does not.
MAX_REPLACED_SHARE = 0.01


def resolve_files(spec: str) -> list[Path]:
    """The files that data.path names, sorted, or a DataError saying why there are none."""
    if glob.has_magic(spec):
        found = [Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)]
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise DataError(f"data.path={spec} does not exist; point it at a file, folder or glob")
        if path.is_file() and path.suffix not in SUFFIXES:
            raise DataError(
                f"data.path={spec} is a {path.suffix or 'suffix-less'} file; use one of {', '.join(SUFFIXES)}"
            )
        found = [path] if path.is_file() else list(path.rglob("*"))
    files = sorted(p for p in found if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise DataError(
            f"data.path={spec} matched no {'/'.join(SUFFIXES)} files; check the path or glob"
        )
    return files


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix in TEXT_SUFFIXES:
        yield read_utf8_text(path)
    elif path.suffix == ".jsonl":
        yield from _jsonl(path, text_field)
    else:
        yield from _parquet(path, text_field)


def read_utf8_text(path: Path) -> str:
    """The file's text, with a few undecodable bytes replaced (U+FFFD); refused when they
    are more than MAX_REPLACED_SHARE of it: binary or another encoding, not text to train on."""
    text = read_text(path)
    replaced = text.count("\ufffd")
    if replaced > MAX_REPLACED_SHARE * len(text):
        raise DataError(
            f"{path} is not UTF-8 text ({replaced} of {len(text)} characters do not decode: "
            "binary, or another encoding); re-encode it as UTF-8 (iconv -t utf-8) or remove "
            "it from data.path"
        )
    return text


def _jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{lineno} is not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); re-encode the file as UTF-8 or remove the line"
                ) from err
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({err.msg}); fix or remove the line"
                ) from err
            if not isinstance(row, dict) or text_field not in row:
                raise DataError(
                    f"{path}:{lineno} has no {text_field!r} field; set data.text_field to the key holding the text"
                )
            yield str(row[text_field])


def _parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa  # only data=files with parquet needs it
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DataError(
                f"{path} has no column {text_field!r} (it has {', '.join(names)}); "
                "set data.text_field to the column holding the text"
            )
        for batch in pf.iter_batches(columns=[text_field]):
            yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)
    except (pa.ArrowException, OSError) as err:  # a bad footer, page or thrift header
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(
            f"{path} is not a readable Parquet file ({reason}); re-export it, or remove it "
            "from data.path"
        ) from err


def split_single_text(text: str, split: str, val_fraction: float) -> str:
    """One document alone (say tiny-shakespeare.txt): its tail, cut at a line end, is val."""
    cut = int(len(text) * (1.0 - val_fraction))
    line_end = text.rfind("\n", 0, cut)
    cut = line_end + 1 if line_end > 0 else cut
    return text[:cut] if split == "train" else text[cut:]


class FilesCorpus:
    name = "files"

    def __init__(self, spec: str, text_field: str, val_fraction: float) -> None:
        self.files = resolve_files(spec)
        self.text_field = text_field
        self.val_fraction = val_fraction
        self.root = Path(os.path.commonpath([f.parent.resolve() for f in self.files]))
        rel = [f.resolve().relative_to(self.root).as_posix() for f in self.files]
        self.split_files = split_by_key(self.files, rel, val_fraction)
        stats = file_stats(self.root, [f.resolve() for f in self.files])
        self._digest = digest_of(self.name, text_field, val_fraction, stats)

    @property
    def digest(self) -> str:
        return self._digest

    def documents(self, split: str) -> Iterator[str]:
        if len(self.files) > 1:
            for f in self.split_files[split]:
                yield from read_documents(f, self.text_field)
            return
        # One file: split by document instead, with the same stable rule on document indices.
        docs = list(read_documents(self.files[0], self.text_field))
        if len(docs) == 1:
            yield split_single_text(docs[0], split, self.val_fraction)
            return
        held = val_keys([str(i) for i in range(len(docs))], self.val_fraction)
        for i, doc in enumerate(docs):
            if (str(i) in held) == (split == "val"):
                yield doc
