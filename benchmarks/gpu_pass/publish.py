"""``python -m benchmarks.gpu_pass.publish [--out DIR ...]`` (``make gpu-publish``): the
pass's tables into the docs, each in place of its block

    <!-- gpu-pass:SECTION -->
    ...
    <!-- /gpu-pass:SECTION -->

in the page ``PAGES`` names, dated, with the device, the record and its commit named.
Without ``--out`` it reads every record committed under docs/gpu_pass/ (oldest first: by
the date its folder's name begins with, then by its commit's time) and a section none of
them holds is "pending"; with ``--out`` only the records named (two parts run apart, or a
rerun of one section), and the other blocks stay as they are. Records are read in order: a section's entry from a later record replaces an earlier
one's, unless the later one has no rows and the earlier one has.

Refused, in one line and before any page is written: a dry run's record (its figures are
CPU code-path checks, not measurements) and a record from a working tree with uncommitted
changes (its figures belong to no commit). A record that names no commit (recorded before
records did) is published with "commit unknown" in each of its blocks.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

from benchmarks.gpu_pass.report import commit_line, load, section_markdown
from benchmarks.gpu_pass.sections import SECTIONS

REPO = Path(__file__).resolve().parents[2]
RECORDS = "docs/gpu_pass"
PAGES = {
    "speed": "docs/benchmarks.md",
    "gpu_tests": "docs/benchmarks.md",
    "model_step": "docs/benchmarks.md",
    "nccl": "docs/parallel.md",
    "optimizers": "docs/benchmarks.md",
    "fp8": "docs/benchmarks.md",
    "fp8_gemm": "docs/benchmarks.md",
    "attention": "docs/attention.md",
    "recompute": "docs/recompute.md",
    "estimator": "docs/recompute.md",
    "calibrate": "docs/parallel.md",
    "rehearse": "docs/parallel.md",
    "inference": "docs/inference.md",
    "quantization": "docs/inference.md",
}
PENDING = (
    "Pending: no committed GPU record holds this section yet (`make gpu-pass`, its record "
    "under docs/gpu_pass/, then `make gpu-publish`).\n"
)


def committed(root: Path = REPO) -> list[Path]:
    """Every record under docs/gpu_pass/, oldest first: by the date that begins its folder's
    name, then, within a day, by the time of the commit it ran from (a record that names
    none, or whose commit git does not know, first), then by name."""
    records = [p.parent for p in (root / RECORDS).glob("*/gpu_pass.json")]
    return sorted(records, key=lambda d: (d.name[:10], _commit_time(d), d.name))


def _commit_time(record: Path) -> int:
    """The commit time of the record's commit in this repository's history; 0 for none."""
    sha = (load(record).get("provenance") or {}).get("sha")
    if not sha:
        return 0
    done = subprocess.run(
        ["git", "-C", str(REPO), "show", "-s", "--format=%ct", sha],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else 0


def _has_rows(entry: dict) -> bool:
    return bool(entry.get("result") and entry["result"]["rows"])


def _checked(out: Path) -> dict:
    record = load(out)
    if not record["sections"]:
        raise SystemExit(f"{out}: no gpu_pass.json with sections; run make gpu-pass first")
    if record.get("dry"):
        raise SystemExit(f"{out}: a dry run's record; publish a GPU run's (make gpu-pass)")
    if (record.get("provenance") or {}).get("dirty"):
        raise SystemExit(
            f"{out}: recorded from a working tree with uncommitted changes; publish a record "
            "of a commit (commit, then make gpu-pass)"
        )
    return record


def _name(out: Path, root: Path) -> str:
    try:
        return out.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(out)


def merged(outs: list[Path], root: Path = REPO) -> dict[str, dict]:
    """Each section's entry across the records, later records first unless rowless, with
    the record it came from (``source``: its folder and commit)."""
    records = [(out, _checked(out)) for out in outs]  # every refusal before any write
    sections: dict[str, dict] = {}
    for out, record in records:
        source = f"Record: `{_name(out, root)}`, {commit_line(record)}."
        for name, entry in record["sections"].items():
            if name in sections and _has_rows(sections[name]) and not _has_rows(entry):
                continue
            sections[name] = {**entry, "source": source}
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


def body(name: str, entry: dict) -> str:
    env = entry["env"]
    head = f"GPU pass of {env['date']} on one {env['device']} (`make gpu-pass`). {entry['source']}"
    return f"{head}\n\n{section_markdown(name, entry)}"


def publish(outs: list[Path], root: Path = REPO, pending: bool = False) -> list[str]:
    """Write every section's block (``pending``: those no record holds say so); returns the
    pages written."""
    entries = merged(outs, root)
    bodies = {name: body(name, entry) for name, entry in entries.items()}
    if pending:
        bodies.update({s.name: PENDING for s in SECTIONS if s.name not in entries})
    pages: dict[str, str] = {}
    for name, text in bodies.items():
        page = PAGES[name]
        pages[page] = replace_block(pages.get(page) or (root / page).read_text(), name, text, page)
    for page, text in pages.items():
        (root / page).write_text(text)
    return sorted(pages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", nargs="+", help=f"records, oldest first (default: every one under {RECORDS}/)"
    )
    a = p.parse_args(argv)
    outs = [Path(o) for o in a.out] if a.out else committed()
    for page in publish(outs, pending=not a.out):
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
