"""Data preparation per node (issue 41, item 2; llm/data/per_node.py): two torchrun "nodes"
on this host (``--nnodes 2``, one rank each, a c10d rendezvous on 127.0.0.1), training a
BPE tokenizer and tokenising a corpus that takes longer than ``launcher.timeout_min``.

- each node with a cache folder of its own: both prepare (each in its own folder), neither
  times out, and the two folders hold the same bytes;
- both nodes on one folder: rank 0's marker is found there, so the data is prepared once.
"""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

import pytest
from test_torchrun_nodes import Node

from llm.data.corpora import stdlib_files
from llm.launch.launcher import free_port

pytestmark = pytest.mark.slow

TIMEOUT_MIN = 0.1  # 6 s: shorter than the preparation below
CORPUS_BYTES = 5_000_000
TRAINED = re.compile(r"trained a \d+-token BPE in ([\d.]+)s")
TOKENISED = re.compile(r"tokenised files/\w+: .* in ([\d.]+)s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About CORPUS_BYTES of the standard library's sources, as data=files reads them."""
    root, size = tmp_path_factory.mktemp("corpus"), 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # Test suites left out: some hold deliberately undecodable files, which data=files refuses.
    sources = [p for p in stdlib_files(stdlib) if "test" not in p.relative_to(stdlib).as_posix()]
    for i, path in enumerate(sources):
        if size >= CORPUS_BYTES:
            break
        shutil.copy(path, root / f"{i:05d}_{path.name}")
        size += path.stat().st_size
    return root


def _args(out: Path, corpus: Path) -> list[str]:
    return [
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        "model=gpt2-tiny",
        "data=files",
        f"data.path={corpus}",
        "data.tokenizer=bpe",
        "data.vocab_size=2048",
        "data.seq_len=64",
        "data.val_samples=8",
        "train.device=cpu",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.log_every=1",
        "logger=none",
        "logger.progress=false",
        "parallelism=ddp",
        "launcher=torchrun",
        f"launcher.timeout_min={TIMEOUT_MIN}",
    ]


def _train_on_two_nodes(tmp_path, corpus, caches: dict[str, Path]) -> dict[str, str]:
    """Both agents to the end; returns each node's log."""
    port, run_id = free_port(), f"llm-data-{tmp_path.name}"
    args = _args(tmp_path / "run", corpus)
    nodes = [
        Node(tmp_path, name, port, run_id, name == "host", 1, args, 0, {"LLM_CACHE_DIR": str(c)})
        for name, c in caches.items()
    ]
    try:
        for node in nodes:
            assert node.agent.wait(timeout=900) == 0, node.log()[-4000:]
    finally:
        for node in nodes:
            if node.agent.poll() is None:
                node.kill_node()
    return {node.name: node.log() for node in nodes}


def _prepared_seconds(log: str) -> float:
    return sum(float(s) for s in TRAINED.findall(log) + TOKENISED.findall(log))


def _cache_files(root: Path) -> dict[str, bytes]:
    """The tokenizer and token caches, by relative path (locks and markers left out)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".lock" and ".runs" not in p.parts
    }


def test_each_node_prepares_its_own_cache(tmp_path, corpus, capsys):
    caches = {"host": tmp_path / "cache_host", "other": tmp_path / "cache_other"}
    logs = _train_on_two_nodes(tmp_path, corpus, caches)
    with capsys.disabled():
        seconds = ", ".join(f"{n} {_prepared_seconds(log):.1f} s" for n, log in logs.items())
        print(f"\npreparation (BPE and tokens) per node: {seconds}; timeout {TIMEOUT_MIN * 60:g} s")
    for name, log in logs.items():
        assert TRAINED.search(log), (name, log[-3000:])
        # Slower than the timeout: a collective waiting on it would have failed.
        assert _prepared_seconds(log) > TIMEOUT_MIN * 60, (name, log[-3000:])
    assert "preparing the data on this node" in logs["other"], logs["other"][-3000:]
    host, other = (_cache_files(c) for c in caches.values())
    assert any(k.startswith("tokenizers/") for k in host)
    assert any(k.endswith("train.bin") for k in host)
    assert host.keys() == other.keys()
    assert all(host[k] == other[k] for k in host), [k for k in host if host[k] != other[k]]
    assert not [p for c in caches.values() for p in (c / ".runs").iterdir()]  # markers gone


def test_a_shared_cache_is_prepared_once(tmp_path, corpus):
    shared = tmp_path / "cache"
    logs = _train_on_two_nodes(tmp_path, corpus, {"host": shared, "other": shared})
    trained = sum(len(TRAINED.findall(log)) for log in logs.values())
    assert trained == 1, logs
    assert all("preparing the data on this node" not in log for log in logs.values())
