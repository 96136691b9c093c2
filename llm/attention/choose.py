"""``python -m llm.attention.choose --from docs/gpu_pass``: the table ``attention=auto``
reads (llm/attention/choices.json), built from the committed GPU pass records.

The package reads only the table at run time, never docs/, so a copy of llm/ without the
records still resolves ``auto``; ``--check`` (and tests/test_attention_auto.py) refuses a
table that differs from what the records give, so it cannot go stale silently.

Which rows count: each record's ``attention`` section, records oldest first by folder name
(as ``make gpu-publish`` reads them), a dry run's record and one from a working tree with
uncommitted changes left out. Per device (its name and compute capability) the latest record
with attention rows wins: a pass resumed from earlier calls carries their rows forward. A
row that failed the accuracy check is never ranked. Per (dtype, head dim, mask, T) the
backends are ranked by forward+backward time, fastest first: training runs both.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from llm.attention.auto import TABLE

DTYPES = ("bfloat16", "float16", "float32")


def commit_line(record: dict) -> str:
    """The commit a record ran from, or why it is unknown (as the published blocks say)."""
    prov = record.get("provenance") or {}
    if not prov.get("sha"):
        return f"commit unknown: {prov.get('note') or 'the record names none'}"
    return f"commit {prov['sha'][:12]}"


def _dtype(result: dict) -> str:
    """The sweep's dtype, which its rows do not carry: the section's ``shapes`` line names
    it (benchmarks/gpu_pass/attention.py), one for the whole sweep."""
    found = set(re.findall(r"\b(" + "|".join(DTYPES) + r")\b", result["shapes"]))
    if len(found) != 1:
        raise SystemExit(f"attention section names no single dtype: {result['shapes']!r}")
    return found.pop()


def _usable(record: dict) -> bool:
    entry = record.get("sections", {}).get("attention") or {}
    rows = (entry.get("result") or {}).get("rows")
    dirty = (record.get("provenance") or {}).get("dirty")
    return bool(rows) and not record.get("dry") and not entry.get("dry") and not dirty


def _shapes(result: dict) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    dtype = _dtype(result)
    for row in result["rows"]:
        if row.get("accurate") is False:
            continue
        mask = "documents" if row["docs"] else "causal"
        key = (dtype, row["head_dim"], mask, row["seq_len"])
        groups.setdefault(key, []).append(row)
    return [
        {
            "dtype": dtype,
            "head_dim": d,
            "mask": mask,
            "seq_len": t,
            "ranked": [
                [r["backend"], round(r["fwd_bwd_tflops"], 1)]
                for r in sorted(rows, key=lambda r: r["fwd_bwd_ms"])
            ],
        }
        for (dtype, d, mask, t), rows in sorted(groups.items())
    ]


def build_table(src: Path, label: str) -> dict:
    """The table from every ``*/gpu_pass.json`` under ``src``; records are named
    ``label/<folder>`` (label: how the repository spells ``src``, e.g. docs/gpu_pass)."""
    devices: dict[tuple[str, str], dict] = {}
    for path in sorted(src.glob("*/gpu_pass.json")):
        record = json.loads(path.read_text())
        if not _usable(record):
            continue
        entry = record["sections"]["attention"]
        env = entry["env"]
        devices[env["device"], env["capability"]] = {
            "device": env["device"],
            "capability": env["capability"],
            "record": f"{label}/{path.parent.name}",
            "commit": commit_line(record),
            "torch": env["torch"],
            "shapes": _shapes(entry["result"]),
        }
    return {"devices": [devices[k] for k in sorted(devices)]}


def dumps(table: dict) -> str:
    return json.dumps(table, indent=1) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", default="docs/gpu_pass", help="the records' folder")
    p.add_argument("--out", type=Path, default=TABLE)
    p.add_argument("--check", action="store_true", help="refuse if --out differs; write nothing")
    a = p.parse_args(argv)
    text = dumps(build_table(Path(a.src), a.src.rstrip("/")))
    if a.check:
        if not a.out.is_file() or a.out.read_text() != text:
            raise SystemExit(f"{a.out} differs from {a.src}; run python -m llm.attention.choose")
        return
    a.out.write_text(text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
