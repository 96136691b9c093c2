"""data=wikitext2 / wikitext103 through Hugging Face ``datasets``.

``load_dataset`` serves the dataset from the Hugging Face cache when offline. data.hub_id
may name a local copy of the hub repository instead (a folder laid out like it, with its
README.md ``configs``); the code path is the same, which is how the tests exercise it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from llm.data.sources import digest_of, file_stats
from llm.errors import DataError

DEFAULT_HUB_ID = "Salesforce/wikitext"
HUB_CONFIGS = {"wikitext2": "wikitext-2-raw-v1", "wikitext103": "wikitext-103-raw-v1"}
HUB_SPLITS = {"train": "train", "val": "validation"}


def is_title(row: str) -> bool:
    """A top-level heading row, " = Title = "; sections are " = = Section = = "."""
    s = row.strip()
    return len(s) > 4 and s.startswith("= ") and s.endswith(" =") and s[2] != "="


def join_articles(rows: Iterable[str]) -> Iterator[str]:
    """Wikitext rows are lines (each ending in a newline); an article runs from one
    top-level heading to the next. Blank stretches (the rows before a title) are dropped."""
    article: list[str] = []
    for row in rows:
        if is_title(row):
            yield from _nonblank("".join(article))
            article = []
        article.append(row)
    yield from _nonblank("".join(article))


def _nonblank(text: str) -> Iterator[str]:
    if text.strip():
        yield text


class WikitextCorpus:
    def __init__(self, name: str, hub_id: str | None, text_field: str) -> None:
        self.name = name
        self.hub_id = hub_id or DEFAULT_HUB_ID
        self.hub_config = HUB_CONFIGS[name]
        self.text_field = text_field
        local = Path(self.hub_id)
        # The hub copy is immutable per revision; a local copy can change, so its files count.
        stats = file_stats(local, sorted(local.rglob("*.parquet"))) if local.is_dir() else None
        self._digest = digest_of(self.name, self.hub_id, self.hub_config, text_field, stats)

    @property
    def digest(self) -> str:
        return self._digest

    def documents(self, split: str) -> Iterator[str]:
        ds = self._load(HUB_SPLITS[split])
        if self.text_field not in ds.column_names:
            raise DataError(
                f"{self.hub_id} has no column {self.text_field!r} (it has "
                f"{', '.join(ds.column_names)}); set data.text_field"
            )
        rows = (t for batch in ds.iter(batch_size=10_000) for t in batch[self.text_field])
        yield from join_articles(rows)

    def _load(self, hub_split: str):
        import datasets  # slow to import; only the wikitext corpora need it

        try:
            return datasets.load_dataset(self.hub_id, self.hub_config, split=hub_split)
        except (ConnectionError, FileNotFoundError) as err:
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            raise DataError(
                f"data={self.name}: cannot load {self.hub_id} ({self.hub_config}) from the hub or "
                f"the Hugging Face cache ({reason}); run once with network access, or set "
                "HF_DATASETS_CACHE to a cache that holds it, or use data=files data.path=..."
            ) from err
