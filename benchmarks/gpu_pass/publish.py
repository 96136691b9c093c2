"""``python -m benchmarks.gpu_pass.publish --out DIR [DIR ...]`` (``make gpu-publish``): the
pass's tables into the docs, each in place of its block

    <!-- gpu-pass:SECTION -->
    ...
    <!-- /gpu-pass:SECTION -->

in the page ``PAGES`` names, dated, with the device named. Several DIRs (two parts run
apart, or a rerun of one section) are read in order: a section's entry from a later DIR
replaces an earlier one, unless the later one has no rows and the earlier one has.
A dry run's record is refused: its figures are CPU code-path checks, not measurements.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.gpu_pass.report import load, section_markdown

REPO = Path(__file__).resolve().parents[2]
PAGES = {
    "gpu_tests": "docs/benchmarks.md",
    "model_step": "docs/benchmarks.md",
    "optimizers": "docs/benchmarks.md",
    "fp8": "docs/benchmarks.md",
    "attention": "docs/attention.md",
    "recompute": "docs/recompute.md",
    "estimator": "docs/recompute.md",
}


def _has_rows(entry: dict) -> bool:
    return bool(entry.get("result") and entry["result"]["rows"])


def merged(outs: list[Path]) -> dict[str, dict]:
    """Each section's entry across the records, later records first unless rowless."""
    sections: dict[str, dict] = {}
    for out in outs:
        record = load(out)
        if not record["sections"]:
            raise SystemExit(f"{out}: no gpu_pass.json with sections; run make gpu-pass first")
        if record.get("dry"):
            raise SystemExit(f"{out}: a dry run's record; publish a GPU run's (make gpu-pass)")
        for name, entry in record["sections"].items():
            if name in sections and _has_rows(sections[name]) and not _has_rows(entry):
                continue
            sections[name] = entry
    return sections


def block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- gpu-pass:{name} -->\n).*?(<!-- /gpu-pass:{name} -->)", re.DOTALL)


def replace_block(text: str, name: str, body: str, page: str) -> str:
    pattern = block(name)
    if not pattern.search(text):
        raise SystemExit(
            f"{page} has no <!-- gpu-pass:{name} --> ... <!-- /gpu-pass:{name} --> block; "
            "add one where the figures belong"
        )
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text, count=1)


def publish(outs: list[Path], root: Path = REPO) -> list[str]:
    """Write every section's block; returns the pages written."""
    pages: dict[str, str] = {}
    for name, entry in merged(outs).items():
        page = PAGES[name]
        text = pages.get(page) or (root / page).read_text()
        env = entry["env"]
        head = f"GPU pass of {env['date']} on one {env['device']} (`make gpu-pass`):\n\n"
        pages[page] = replace_block(text, name, head + section_markdown(name, entry), page)
    for page, text in pages.items():
        (root / page).write_text(text)
    return sorted(pages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", nargs="+", required=True, help="the pass's folders, oldest first")
    a = p.parse_args(argv)
    for page in publish([Path(o) for o in a.out]):
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
