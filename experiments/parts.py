"""What an experiment's config file says about its GPU scale, in its comments:

- the opening comment block: the scale choices (model, tokens seen, seeds, why enough),
  quoted at the head of the report;
- ``# part NAME: OVERRIDE ...``: a named part of the sweep (``part=NAME``), the overrides
  that narrow the sweep to its jobs, each part sized to one short GPU run;
- ``# claim KEY needs parts: NAME ...``: the parts whose jobs a claim's verdict needs (a
  claim not named needs every job, follow-ups included);
- ``# needs GPUS: N ...``: the experiment needs several GPUs, the counts its sweep uses.
"""

from __future__ import annotations

import re
from pathlib import Path

from experiments.runner import CONF
from llm.errors import ConfigError

FOLLOW_UPS = "follow_ups"  # part=follow_ups: only the follow-up sweeps (after every part)
_PART = re.compile(r"^# part (\w+): (.+)$")
_CLAIM = re.compile(r"^# claim (\w+) needs parts: (.+)$")
_GPUS = re.compile(r"^# needs GPUS: ([\d ]+)$")


def _lines(config: str, conf: Path = CONF) -> list[str]:
    path = conf / "experiment" / f"{config}.yaml"
    return path.read_text().splitlines() if path.exists() else []


def parts_of(config: str, conf: Path = CONF) -> dict[str, list[str]]:
    return {m[1]: m[2].split() for ln in _lines(config, conf) if (m := _PART.match(ln))}


def claim_parts_of(config: str, conf: Path = CONF) -> dict[str, tuple[str, ...]]:
    return {m[1]: tuple(m[2].split()) for ln in _lines(config, conf) if (m := _CLAIM.match(ln))}


def gpus_needed(config: str, conf: Path = CONF) -> list[int]:
    found = [m[1].split() for ln in _lines(config, conf) if (m := _GPUS.match(ln))]
    return [int(n) for n in found[0]] if found else []


def gpus_for(config: str, overrides: list[str], conf: Path = CONF) -> int:
    """The GPUs a run of ``config`` with ``overrides`` (a part's included) needs: its
    ``launcher.nproc_per_node`` where given, else the most the config names (1 where it
    names none)."""
    counts = gpus_needed(config, conf)
    if not counts:
        return 1
    asked = [o.split("=", 1)[1] for o in overrides if _key(o) == "launcher.nproc_per_node"]
    return max(int(n) for n in asked[-1].split(",")) if asked else max(counts)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def scale_notes(config: str, conf: Path = CONF) -> list[str]:
    """The opening comment block, less the ``# @package`` line and the part lines."""
    notes = []
    for ln in _lines(config, conf):
        if not ln.startswith("#"):
            break
        text = ln.lstrip("#").strip()
        if not ln.startswith("# @package") and not _PART.match(ln) and not _CLAIM.match(ln):
            notes.append(text)
    return notes


def part_overrides(config: str, part: str | None, conf: Path = CONF) -> list[str]:
    """The overrides of ``part`` (none for the whole sweep or its follow-ups); an unknown
    part is refused, naming those there are."""
    if part is None or part == FOLLOW_UPS:
        return []
    parts = parts_of(config, conf)
    if part not in parts:
        there = ", ".join([*parts, FOLLOW_UPS]) if parts else f"none (only {FOLLOW_UPS})"
        raise ConfigError(
            f"{config} has no part {part}; its parts: {there} (the '# part' lines of "
            f"conf/experiment/{config}.yaml)"
        )
    return parts[part]
