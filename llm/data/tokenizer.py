"""Tokenizers behind one small protocol: bytes, our own byte-level BPE, or a local HF tokenizer.

Documents are separated by ``eos_id`` in the token stream; ``digest`` keys the token caches,
so it changes whenever the ids a text maps to could change.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import tokenizers
from filelock import FileLock
from tokenizers import decoders, models, pre_tokenizers, trainers

from llm.config import DataConfig
from llm.data.corpora import Corpus, cache_root
from llm.errors import ConfigError, DataError, DiskFullError
from llm.runfiles.disk import no_space_message, says_no_space

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# End-of-text spellings of common tokenizers, for a bare tokenizer.json without a config.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    digest: str

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    digest = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A fast (Rust) ``tokenizers.Tokenizer``: encode_batch runs on all cores."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_id: int) -> None:
        self.backend = backend
        self.eos_id = eos_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.digest = hashlib.sha256(f"{backend.to_str()}|eos={eos_id}".encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        # No special tokens (BOS/CLS): documents are delimited by eos alone.
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips the character offsets we never use.
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def build_tokenizer(cfg: DataConfig, corpus: Corpus) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        return load_or_train_bpe(corpus, cfg)
    return load_hf_tokenizer(cfg.tokenizer)


def train_texts(corpus: Corpus, max_bytes: int) -> Iterator[str]:
    """The train split's first ``max_bytes`` of text (the last document cut to fit)."""
    left = max_bytes
    for doc in corpus.documents("train"):
        size = len(doc.encode("utf-8"))
        if size >= left:
            yield doc.encode("utf-8")[:left].decode("utf-8", errors="ignore")
            return
        left -= size
        yield doc


def train_bpe(texts: Iterator[str], vocab_size: int) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE: every byte is in the alphabet, so no text is unknown."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _read_tokenizer_file(path: Path) -> tokenizers.Tokenizer:
    """``tokenizers.Tokenizer.from_file``, whose parse errors are plain Exceptions, as a
    DataError naming the file."""
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust parser raises bare Exception
        raise DataError(
            f"{path} is not a valid tokenizer.json ({_first_line(err)}); save it again with "
            "tokenizer.save_pretrained(DIR), or use data.tokenizer=bpe"
        ) from err


def load_or_train_bpe(corpus: Corpus, cfg: DataConfig) -> HFTokenizer:
    key = f"bpe-{cfg.vocab_size}-{cfg.tokenizer_train_bytes}-{corpus.name}-{corpus.digest[:16]}"
    path = cache_root(cfg) / "tokenizers" / f"{key}.json"
    backend = _cached_bpe(path)
    if backend is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Processes training the same tokenizer at once (one node's ranks, or nodes sharing
        # the folder) train it once: the others wait here and read what the first wrote.
        with FileLock(path.with_name(f"{path.name}.lock")):
            backend = _cached_bpe(path)
            if backend is None:
                backend = _train_and_save(corpus, cfg, path)
    return HFTokenizer(backend, backend.token_to_id(EOS_TOKEN))


def _train_and_save(corpus: Corpus, cfg: DataConfig, path: Path) -> tokenizers.Tokenizer:
    start = time.perf_counter()
    backend = train_bpe(train_texts(corpus, cfg.tokenizer_train_bytes), cfg.vocab_size)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    backend.save(str(tmp))
    os.replace(tmp, path)  # atomic: a reader outside the lock sees no file or a whole one
    log.info(
        "trained a %d-token BPE in %.1fs -> %s", cfg.vocab_size, time.perf_counter() - start, path
    )
    return backend


def _cached_bpe(path: Path) -> tokenizers.Tokenizer | None:
    """The trained BPE cached at ``path``; None when there is none, or when it is corrupt
    (it is then trained again: the cache is ours to rebuild)."""
    if not path.exists():
        return None
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust parser raises bare Exception
        log.warning("tokenizer cache %s is corrupt (%s); training it again", path, _first_line(err))
        return None


def load_hf_tokenizer(spec: str) -> HFTokenizer:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"data.tokenizer={spec!r} is not byte, bpe or an existing tokenizer folder or "
            "tokenizer.json; fix the path (save one with tokenizer.save_pretrained(DIR)) or use bpe"
        )
    if path.is_file():
        backend = _read_tokenizer_file(path)
        eos_id = next(
            (i for t in EOS_CANDIDATES if (i := backend.token_to_id(t)) is not None), None
        )
    else:
        from transformers import AutoTokenizer  # slow to import; only this path needs it

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as err:  # transformers raises OSError, ValueError or the parser's
            raise DataError(
                f"tokenizer folder {path} cannot be loaded ({_first_line(err)}); save it "
                "again with tokenizer.save_pretrained(DIR), or use data.tokenizer=bpe"
            ) from err
        if not hasattr(hf, "backend_tokenizer"):
            raise DataError(
                f"{spec} has no fast tokenizer; save it with tokenizer.json (a fast tokenizer)"
            )
        backend, eos_id = hf.backend_tokenizer, hf.eos_token_id
    if eos_id is None:
        raise DataError(
            f"tokenizer {spec} has no end-of-text token ({', '.join(EOS_CANDIDATES)}); "
            "use its folder with a tokenizer_config.json that sets eos_token"
        )
    return HFTokenizer(backend, eos_id)


TOKENIZER_FILE = "tokenizer.json"  # beside a run's checkpoints: what llm.generate decodes with


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Write ``tokenizer`` to ``folder/tokenizer.json`` (atomically) so the run's checkpoints
    decode without its corpus or cache; the byte tokenizer has nothing to save."""
    if not isinstance(tokenizer, HFTokenizer):
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{TOKENIZER_FILE}.{os.getpid()}.tmp"
    try:
        # Written by Python, not the Rust writer, so a full disk is an OSError with its errno.
        tmp.write_text(tokenizer.backend.to_str(pretty=True))
        os.replace(tmp, folder / TOKENIZER_FILE)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if says_no_space(exc):
            raise DiskFullError(no_space_message(folder, "the run's tokenizer")) from None
        raise


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte``, a tokenizer.json or a tokenizer folder (as data.tokenizer names them)."""
    return ByteTokenizer() if spec == "byte" else load_hf_tokenizer(spec)
