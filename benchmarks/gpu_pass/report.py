"""The pass's record: ``gpu_pass.json`` (every section's entry) and its markdown, which
``publish`` also writes into the docs."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_pass.common import NOT_MEASURED, fmt

JSON_NAME, MD_NAME, LOG_NAME = "gpu_pass.json", "gpu_pass.md", "gpu_pass.log"


def load(out: Path) -> dict:
    path = out / JSON_NAME
    return json.loads(path.read_text()) if path.exists() else {"sections": {}}


def save(out: Path, record: dict) -> None:
    (out / JSON_NAME).write_text(json.dumps(record, indent=1))
    (out / MD_NAME).write_text(markdown(record))


def goal_line(goal: dict) -> str:
    head = f"- {goal['name']} (goal: {goal['target']})"
    if goal["met"] is None and goal["value"] == NOT_MEASURED:
        return f"{head}: {NOT_MEASURED}"
    verdict = {True: "**met**", False: "**missed**", None: "not judged"}[goal["met"]]
    return f"{head}: {goal['value']}: {verdict}"


def commit_line(record: dict) -> str:
    """The commit a record ran from, or why it is unknown."""
    prov = record.get("provenance") or {}
    if not prov.get("sha"):
        return f"commit unknown: {prov.get('note') or 'the record names none'}"
    return f"commit {prov['sha'][:12]}" + (" with uncommitted changes" if prov.get("dirty") else "")


def _short(note: str, limit: int = 400) -> str:
    """A note as one readable line: a long list is cut, the JSON keeps it whole."""
    return note if len(note) <= limit else note[:limit].rsplit(";", 1)[0] + "; ... (gpu_pass.json)"


def table(columns: list[str], rows: list[dict]) -> str:
    head = "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)


def section_markdown(name: str, entry: dict) -> str:
    """One section: what ran where (device, versions, date, shapes, command), its status,
    its table, its goals met or missed, and its notes."""
    env = entry["env"]
    result = entry.get("result")
    lines = [
        f"#### {name}: {result['title'] if result else 'no result'}",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
        f"{env['date']}{' (dry run on CPU, tiny sizes)' if entry.get('dry') else ''}. "
        f"Command: `{entry['command']}`. Status: {entry['status']} ({entry['seconds']:.0f} s).",
    ]
    if result:
        lines += ["", f"Shapes: {result['shapes']}.", "", table(result["columns"], result["rows"])]
        lines += [goal_line(g) for g in result["goals"]]
        lines += [f"- {_short(note)}" for note in result["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def markdown(record: dict) -> str:
    sections = record["sections"]
    failed = [n for n, e in sections.items() if e["status"] != "ok"]
    missed = [
        f"{n}: {g['name']}"
        for n, e in sections.items()
        if e.get("result")
        for g in e["result"]["goals"]
        if g["met"] is False
    ]
    head = [
        "# GPU pass",
        "",
        f"From {commit_line(record)}.",
        "",
        f"Sections run: {', '.join(sections) or 'none'}. Failed: {', '.join(failed) or 'none'}. "
        f"Goals missed: {'; '.join(missed) or 'none'}.",
        "",
    ]
    return "\n".join(head) + "\n".join(section_markdown(n, e) for n, e in sections.items())
