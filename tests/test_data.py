"""Corpora, token caches, packing and the sharded, resumable loaders, on tiny local data."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from llm.config import DataConfig
from llm.data import IGNORE, build_train_loader, build_val_loader, prepare_data
from llm.data.cache import token_dtype
from llm.data.corpora import StdlibCorpus, build_corpus
from llm.data.dataset import TokenDataset
from llm.data.loader import TrainLoader, ValLoader
from llm.data.tokenizer import ByteTokenizer
from llm.data.wikitext import join_articles
from llm.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def write_docs(root, n=10):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc_{i:02d}.txt").write_text(
            f"document {i}: " + "lorem ipsum " * (5 + 7 * i) + "\n"
        )
    return root


def cfg_for(path, tmp_path, **kw) -> DataConfig:
    kw = {"tokenizer": "byte", "seq_len": 16, **kw}
    return DataConfig(name="files", path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def stream_dataset(n_tokens=1000, n_docs=10) -> TokenDataset:
    """Tokens 0..n-1 (distinct, so every sample shows where it came from)."""
    tokens = np.arange(n_tokens, dtype=np.int64)
    offsets = np.linspace(0, n_tokens, n_docs + 1).astype(np.int64)
    return TokenDataset(tokens, offsets, eos_id=-1)


def all_docs(corpus, split):
    return list(corpus.documents(split))


# --- corpora ------------------------------------------------------------------------------


def test_stdlib_split_is_deterministic_and_disjoint():
    a, b = StdlibCorpus(0.02), StdlibCorpus(0.02)
    assert len(a.files) > 500 and a.digest == b.digest and a.split_files == b.split_files
    train, val = set(a.split_files["train"]), set(a.split_files["val"])
    assert train.isdisjoint(val) and train | val == set(a.files)
    assert 0.005 < len(val) / len(a.files) < 0.05
    assert not any("site-packages" in f.parts for f in a.files)
    assert StdlibCorpus(0.1).digest != a.digest  # another split is another corpus


def test_files_folder_glob_and_single_file(tmp_path):
    folder = write_docs(tmp_path / "txt", n=30)
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.md").write_text("markdown document\n")
    (folder / "skip.csv").write_text("a,b\n")
    corpus = build_corpus(cfg_for(folder, tmp_path, val_fraction=0.2))
    assert len(corpus.files) == 31  # recursive, and only known suffixes
    train, val = all_docs(corpus, "train"), all_docs(corpus, "val")
    assert train and val and not set(train) & set(val) and len(train) + len(val) == 31

    by_glob = build_corpus(cfg_for(f"{folder}/doc_0*.txt", tmp_path))
    assert [f.name for f in by_glob.files] == [f"doc_0{i}.txt" for i in range(10)]

    # One file with one document: its tail (at a line end) is the validation text.
    single = tmp_path / "one.txt"
    single.write_text("".join(f"line {i}\n" for i in range(100)))
    one = build_corpus(cfg_for(single, tmp_path, val_fraction=0.1))
    (head,), (tail,) = all_docs(one, "train"), all_docs(one, "val")
    assert head + tail == single.read_text() and tail.startswith("line 90\n")


def test_files_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i} " * (i + 1) for i in range(40)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": rows}), parquet)
    for path in (jsonl, parquet):
        corpus = build_corpus(cfg_for(path, tmp_path, text_field="body", val_fraction=0.1))
        train, val = all_docs(corpus, "train"), all_docs(corpus, "val")
        # A single file is split by document.
        assert val and sorted(train + val) == sorted(rows) and not set(train) & set(val)
        with pytest.raises(DataError, match=r"set data\.text_field"):
            all_docs(build_corpus(cfg_for(path, tmp_path, text_field="text")), "train")


def test_files_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_corpus(cfg_for(tmp_path / "missing", tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="matched no"):
        build_corpus(cfg_for(tmp_path / "empty", tmp_path))
    with pytest.raises(DataError, match="matched no"):
        build_corpus(cfg_for(f"{tmp_path}/*.txt", tmp_path))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="use one of"):
        build_corpus(cfg_for(tmp_path / "data.csv", tmp_path))


WIKI_ROWS = ["", " = Alpha = \n", "\n", " Alpha text .\n", " = = Section = = \n", " More .\n",
             " = Beta = \n", " Beta text .\n"]  # fmt: skip


def local_wikitext_repo(root):
    """A folder laid out like the hub repo Salesforce/wikitext (README configs + parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    readme = ["---", "configs:"]
    for config in ("wikitext-2-raw-v1", "wikitext-103-raw-v1"):
        readme += [f"- config_name: {config}", "  data_files:"]
        for split in ("train", "validation", "test"):
            (root / config).mkdir(parents=True, exist_ok=True)
            rows = [r.replace("text", f"{split} text") for r in WIKI_ROWS] * 3
            pq.write_table(
                pa.table({"text": rows}), root / config / f"{split}-00000-of-00001.parquet"
            )
            readme += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (root / "README.md").write_text("\n".join([*readme, "---", ""]))
    return root


def test_join_articles():
    assert list(join_articles(WIKI_ROWS)) == [
        " = Alpha = \n\n Alpha text .\n = = Section = = \n More .\n",
        " = Beta = \n Beta text .\n",
    ]


def test_wikitext_from_local_hub_copy(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    repo = local_wikitext_repo(tmp_path / "wikitext")
    cfg = DataConfig(
        name="wikitext2", hub_id=str(repo), tokenizer="byte", cache_dir=str(tmp_path / "c")
    )
    corpus = build_corpus(cfg)
    val = all_docs(corpus, "val")
    assert len(val) == 6 and val[0].startswith(" = Alpha = \n") and "validation text" in val[0]
    prepared = prepare_data(cfg)
    assert prepared.train.n_documents == 6
    assert "train text" in prepared.tokenizer.decode(prepared.train.tokens[:60].tolist())


def test_wikitext_offline_miss_names_the_fix(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = DataConfig(name="wikitext103", hub_id="llm-lab-tests/not-cached", cache_dir=str(tmp_path))
    with pytest.raises(
        DataError, match=r"run once with network access.*HF_DATASETS_CACHE.*data=files"
    ):
        all_docs(build_corpus(cfg), "train")


# --- token caches ---------------------------------------------------------------------------


def test_token_cache_is_reused_without_tokenising(tmp_path, monkeypatch):
    cfg = cfg_for(write_docs(tmp_path / "docs", n=20), tmp_path, val_fraction=0.2)
    first = prepare_data(cfg)
    tok = first.tokenizer
    docs = all_docs(build_corpus(cfg), "train")
    expected = np.concatenate([[*tok.encode(d), tok.eos_id] for d in docs])
    assert np.array_equal(np.asarray(first.train.tokens), expected)
    assert first.train.tokens.dtype == np.uint16 and first.train.n_documents == len(docs)

    def no_tokenising(self, texts):
        raise AssertionError("the token cache should have been reused")

    monkeypatch.setattr(ByteTokenizer, "encode_batch", no_tokenising)
    again = prepare_data(cfg)
    assert np.array_equal(np.asarray(again.train.tokens), expected)
    assert np.array_equal(again.val.offsets, first.val.offsets)
    with pytest.raises(AssertionError, match="reused"):  # another split is another cache
        prepare_data(cfg_for(tmp_path / "docs", tmp_path, val_fraction=0.5))


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(257) == np.uint16 and token_dtype(65_535) == np.uint16
    assert token_dtype(65_536) == np.uint32  # e.g. Llama 3's 128k vocabulary


def test_unresolved_cache_dir_is_refused():
    with pytest.raises(ConfigError, match="is unresolved"):
        prepare_data(DataConfig())  # the default is a YAML interpolation, resolved by Hydra


def test_concurrent_prepares_agree(tmp_path):
    cfg = cfg_for(write_docs(tmp_path / "docs", n=20), tmp_path)
    results = [None] * 4

    def run(i):
        results[i] = prepare_data(cfg)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = np.asarray(results[0].train.tokens)
    assert all(np.array_equal(np.asarray(r.train.tokens), ref) for r in results)
    assert not list((tmp_path / "cache").rglob("*.tmp"))


# --- samples --------------------------------------------------------------------------------


def test_packing_blocks_are_shifted_by_one():
    ds = stream_dataset(n_tokens=62 * 16 + 1)
    assert ds.num_samples(seq_len=16, packing=True) == 62
    batch = ds.batch([0, 3, 61], seq_len=16, packing=True)
    assert batch.input_ids.shape == batch.targets.shape == (3, 16)
    assert batch.input_ids.dtype == batch.targets.dtype == torch.int64
    assert torch.equal(batch.input_ids[1], torch.arange(48, 64))
    assert torch.equal(batch.targets, batch.input_ids + 1)
    assert int(batch.targets[2, -1]) == 62 * 16  # the last sample reaches the last token


def test_unpacked_samples_pad_inputs_with_eos_and_mask_targets():
    tokens = np.array([5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 0], dtype=np.uint16)
    ds = TokenDataset(tokens, np.array([0, 4, 11]), eos_id=0)
    assert ds.num_samples(seq_len=5, packing=False) == 2
    x, y, _ = ds.batch([0, 1], seq_len=5, packing=False)
    assert x.tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert y.tolist() == [[6, 7, 0, IGNORE, IGNORE], [9, 10, 11, 12, 13]]  # truncated to T+1


# --- loaders --------------------------------------------------------------------------------


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_dp_shards_union_is_the_single_process_batch():
    ds = stream_dataset(n_tokens=2000)
    single = TrainLoader(ds, 16, True, micro_batch_size=8, dp_rank=0, dp_size=1, seed=3)
    ranks = [TrainLoader(ds, 16, True, 4, r, 2, seed=3) for r in range(2)]
    for _ in range(40):  # 124 samples, 8 per step: crosses two epoch boundaries
        whole = next(single).input_ids
        parts = torch.cat([next(r).input_ids for r in ranks])
        assert torch.equal(whole, parts)
    assert single.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()
    assert single.state_dict()["epoch"] == 2


def test_accumulated_micro_batches_equal_one_big_batch():
    ds = stream_dataset(n_tokens=2000)
    big = TrainLoader(ds, 16, True, 12, 0, 1, seed=0)
    small = TrainLoader(ds, 16, True, 4, 0, 1, seed=0)
    for _ in range(5):
        assert torch.equal(next(big).input_ids, torch.cat([b.input_ids for b in take(small, 3)]))


def test_epochs_cover_every_sample_once_and_reshuffle():
    ds = stream_dataset(n_tokens=1601)  # 100 samples of 16
    loader = TrainLoader(ds, 16, True, 10, 0, 1, seed=0)
    first = torch.cat([b.input_ids[:, 0] for b in take(loader, 10)])
    second = torch.cat([b.input_ids[:, 0] for b in take(loader, 10)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 1600, 16))
    assert not torch.equal(first, second)


def test_resume_gives_the_same_batches_on_any_world_size():
    ds = stream_dataset(n_tokens=2000)
    loader = TrainLoader(ds, 16, True, 4, 0, 1, seed=7)
    take(loader, 37)  # into the second epoch
    state = loader.state_dict()
    assert state == {"epoch": 1, "position": 24, "seed": 7}
    expected = take(loader, 20)
    resumed = TrainLoader(ds, 16, True, 4, 0, 1, seed=999)
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(expected, take(resumed, 20), strict=True)
    )
    # The state is a global position: two ranks of 2 resume where one process of 4 stopped.
    ranks = [TrainLoader(ds, 16, True, 2, r, 2, seed=0) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    halves = [take(r, 20) for r in ranks]
    for i, whole in enumerate(expected):
        assert torch.equal(
            whole.input_ids, torch.cat([halves[0][i].input_ids, halves[1][i].input_ids])
        )


def test_val_loader_is_ordered_sharded_and_reiterable():
    ds = stream_dataset(n_tokens=1000)  # 62 samples of 16
    ranks = [ValLoader(ds, 16, True, 3, r, 2, n_samples=62) for r in range(2)]
    assert len(ranks[0]) == 11  # ceil(62 / (3 * 2)); the last global batch is padded
    firsts = [[int(b.input_ids[i, 0]) for b in loader for i in range(3)] for loader in ranks]
    assert firsts[0][:6] == [0, 16, 32, 96, 112, 128] and firsts[1][:3] == [48, 64, 80]
    # A subset is spread over the whole split: first and last sample included.
    spread = real_rows([ValLoader(ds, 16, True, 4, 0, 1, n_samples=5)])
    assert [start for start, _ in spread] == [0, 240, 480, 736, 976]
    assert [b.input_ids.tolist() for b in ranks[0]] == [b.input_ids.tolist() for b in ranks[0]]
    assert ValLoader(ds, 16, True, 20, 0, 1, n_samples=1000).n_samples == 62  # the whole split


def real_rows(loaders):
    """The (first input token, target count) of every non-padding row the loaders yield."""
    rows = []
    for loader in loaders:
        for batch in loader:
            for x, y in zip(batch.input_ids, batch.targets, strict=True):
                if (y != IGNORE).any():
                    rows.append((int(x[0]), int((y != IGNORE).sum())))
    return sorted(rows)


@pytest.mark.parametrize(("micro_batch_size", "dp_size"), [(1, 1), (4, 1), (3, 2), (5, 4)])
def test_val_set_is_the_same_for_any_batch_and_rank_count(micro_batch_size, dp_size):
    ds = stream_dataset(n_tokens=1000)
    reference = real_rows([ValLoader(ds, 16, True, 7, 0, 1, n_samples=22)])
    loaders = [
        ValLoader(ds, 16, True, micro_batch_size, r, dp_size, n_samples=22) for r in range(dp_size)
    ]
    # Every rank runs the same number of micro-batches; padding rows carry no target.
    assert len({len(loader) for loader in loaders}) == 1
    assert real_rows(loaders) == reference and len(reference) == 22


def test_loaders_from_prepared_data_and_too_small_corpus(tmp_path):
    cfg = cfg_for(write_docs(tmp_path / "docs", n=20), tmp_path, seq_len=2048, packing=False)
    prepared = prepare_data(cfg)
    train = build_train_loader(prepared, cfg, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0)
    x, y, _ = next(train)
    assert x.shape == y.shape == (4, 2048)
    # Documents are shorter than seq_len: each sample has its own number of targets.
    n_targets = (y != IGNORE).sum(dim=1)
    assert len(set(n_targets.tolist())) == 4 and (n_targets < 2048).all()
    val = build_val_loader(prepared, cfg, micro_batch_size=1, dp_rank=0, dp_size=1)
    assert len(list(val)) == len(val) > 0
    with pytest.raises(
        DataError, match=r"fewer than one global micro-batch \(micro_batch_size=64 x dp_size=2\)"
    ):
        build_train_loader(prepared, cfg, micro_batch_size=64, dp_rank=1, dp_size=2, seed=0)
