"""``python -m benchmarks.gpu_pass [--part 1|2|all] [--out DIR] [--dry] [--only NAMES]
[--resume DIR ...]``

Runs each section in its own process under its time limit, never stopping at a failure,
and rewrites DIR/gpu_pass.json and gpu_pass.md after every section (a pass cut short keeps
what finished). A second part run into the same DIR joins the first's record. Every
section's output goes to DIR/gpu_pass.log. ``--resume`` names earlier records of the same
device: the sections that sweep (attention, the CUDA tests) keep their rows and measure only
the rest, so a short call finishes what an earlier one ran out of time for; ``--redo``
names the backends (or tests) whose kept rows are measured again. A section's rows are kept
only where every file they depended on is unchanged (the section's digest); the others are
dropped, one line each saying why. The record names the commit it ran from, whether the
tree had changes, and each section's digest (benchmarks/gpu_pass/provenance.py). Exit
status 1 when a section failed or timed out; goals missed are reported, not failures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_pass import provenance
from benchmarks.gpu_pass.common import EARLIER_ENV, LIMIT_ENV, OUT_ENV, PARTIAL_ENV, environment
from benchmarks.gpu_pass.report import LOG_NAME, load, markdown, save
from benchmarks.gpu_pass.sections import DRY_LIMIT_S, Section, selected

REPO = Path(__file__).resolve().parents[2]


def _child_env(limit: float, tmp: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env[LIMIT_ENV], env[PARTIAL_ENV] = str(limit), str(tmp / "partial.json")
    env[provenance.DEPS_ENV] = str(tmp / "modules.json")
    # Compiles land in known folders (the Makefile sets the same ones).
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(REPO / ".cache" / "triton"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def earlier(records: list[dict], name: str, redo: set[str]) -> list[dict]:
    """Section ``name``'s rows in the earlier records, oldest first, less those whose first
    column (attention's backend, a test's id) ``redo`` names: a kernel fixed since."""
    rows = []
    for record in records:
        result = record["sections"].get(name, {}).get("result") or {}
        rows += [r for r in result.get("rows", []) if r.get(result["columns"][0]) not in redo]
    return rows


def unchanged(record: dict, where: str) -> dict:
    """``record`` less the sections whose files changed since it ran (or that name no
    digest), one line printed for each section dropped."""
    kept = {}
    for name, entry in record["sections"].items():
        why = provenance.changed_since(entry, REPO)
        if why is None:
            kept[name] = entry
        else:
            rows = len((entry.get("result") or {}).get("rows", []))
            print(f"gpu pass: --resume {where}: {name}'s {rows} rows dropped: {why}", flush=True)
    return {**record, "sections": kept}


def resumed(dirs: list[str], env: dict, dry: bool) -> list[dict]:
    """The records ``--resume`` names, refused in one line where one is missing or comes
    from another device or mode (its figures would mix machines); of each, the sections
    whose files are unchanged."""
    records = []
    for d in dirs:
        record = load(Path(d))
        if not record["sections"]:
            raise SystemExit(f"--resume {d}: no gpu_pass.json there; name a pass's --out folder")
        if record.get("env", {}).get("device") != env["device"] or record.get("dry") != dry:
            raise SystemExit(
                f"--resume {d}: its record is from {record.get('env', {}).get('device')}"
                f"{' (dry)' if record.get('dry') else ''}, not this {env['device']}"
                f"{' (dry)' if dry else ''}; resume only a record of the same device and mode"
            )
        records.append(unchanged(record, d))
    return records


def run_section(
    section: Section, dry: bool, limit: float, log, earlier_rows: list[dict] | None = None
) -> tuple[str, float, dict | None, list[str]]:
    """(status, seconds, result, the repository files its process imported) of one section
    run in a fresh process group."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json, partial = Path(tmp) / "result.json", Path(tmp) / "partial.json"
        modules = Path(tmp) / "modules.json"
        env = _child_env(limit, Path(tmp))
        if earlier_rows:
            (Path(tmp) / "earlier.json").write_text(json.dumps(earlier_rows))
            env[EARLIER_ENV] = str(Path(tmp) / "earlier.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_pass.section", section.module]
        cmd += ["--json", str(out_json)] + (["--dry"] if dry else [])
        log.write(f"\n===== {section.name} (limit {limit} s) =====\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section and any process it started
            proc.wait()
            rows = json.loads(partial.read_text()) if partial.exists() else None
            kept = " (the rows it finished are kept)" if rows else ""
            status, result = f"timed out after {limit} s{kept}", rows
        else:
            done = code == 0 and out_json.exists()
            status = "ok" if done else f"failed (exit {code}; see {LOG_NAME})"
            result = json.loads(out_json.read_text()) if done else None
        files = json.loads(modules.read_text()) if modules.exists() else []
        return status, time.monotonic() - start, result, files


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="all", choices=["1", "2", "all"])
    p.add_argument("--out", default="outputs/gpu_pass", help="folder for json, md and log")
    p.add_argument("--dry", action="store_true", help="every section on CPU at tiny sizes")
    p.add_argument("--only", help="comma list of sections (instead of --part)")
    p.add_argument(
        "--limit-scale", type=float, default=1.0,
        help="multiply every section's time limit (a machine booked for less time)",
    )  # fmt: skip
    p.add_argument(
        "--limit", action="append", default=[], metavar="SECTION=SECONDS",
        help="one section's time limit in seconds (repeatable; overrides --limit-scale)",
    )  # fmt: skip
    p.add_argument(
        "--resume", action="append", default=[], metavar="DIR",
        help="an earlier record of this device whose attention rows and passed tests are kept",
    )  # fmt: skip
    p.add_argument(
        "--redo", default="", metavar="NAMES",
        help="comma list: --resume's rows of these backends (or tests) are measured again",
    )  # fmt: skip
    return p.parse_args(argv)


def limits(sections: list[Section], a: argparse.Namespace) -> dict[str, float]:
    """Each section's limit: its own (the dry run's on CPU) times --limit-scale, or --limit."""
    out = {s.name: round((DRY_LIMIT_S if a.dry else s.limit_s) * a.limit_scale) for s in sections}
    for item in a.limit:
        name, _, seconds = item.partition("=")
        if name not in out or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item}: use SECTION=SECONDS for one of {', '.join(out)}")
        out[name] = float(seconds)
    return out


def record_provenance(record: dict, tree: provenance.Tree) -> dict:
    """The record's provenance: the tree's commit, and each section's digest. Where the
    commit comes from a stamp, a file a section read that the stamp does not list (added
    after it was written) makes the tree dirty."""
    sections = {name: entry["provenance"] for name, entry in record["sections"].items()}
    out = {**tree.record(), "digests": {name: p["digest"] for name, p in sections.items()}}
    new = sorted({f for p in sections.values() for f in p["files"]} - (tree.stamped or set()))
    if tree.stamped is not None and new:
        out.update(dirty=True, note=f"files not in {provenance.STAMP_NAME}: {', '.join(new[:3])}")
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    sections = selected(a.part, a.only)
    limit = limits(sections, a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ[OUT_ENV] = str(out.resolve())  # each section's process writes its files there
    env = environment()
    tree = provenance.current(REPO, skip=(out,))
    records = resumed(a.resume, env, a.dry)
    record = load(out)
    # A record from another device, mode or tree is not joined: its figures would mix them.
    commit = {k: record.get("provenance", {}).get(k) for k in ("sha", "dirty")}
    if (
        record.get("env", {}).get("device") != env["device"]
        or record.get("dry") != a.dry
        or tree.sha is None
        or commit != {"sha": tree.sha, "dirty": tree.dirty}
    ):
        record = {"sections": {}}
    record.update(env=env, dry=a.dry)
    redo = {n.strip() for n in a.redo.split(",") if n.strip()}
    flags = (" --dry" if a.dry else "") + "".join(f" --resume {d}" for d in a.resume)
    flags += f" --redo {a.redo}" if redo else ""
    with (out / LOG_NAME).open("a") as log:
        for section in sections:
            print(f"gpu pass: {section.name} (part {section.part}) ...", flush=True)
            status, seconds, result, modules = run_section(
                section, a.dry, limit[section.name], log, earlier(records, section.name, redo)
            )
            record["sections"][section.name] = {
                "part": section.part,
                "status": status,
                "seconds": seconds,
                "dry": a.dry,
                "command": f"python -m benchmarks.gpu_pass --only {section.name}{flags}",
                "env": env,
                "result": result,
                "provenance": provenance.section_files(modules, section.data, REPO),
            }
            record["provenance"] = record_provenance(record, tree)
            save(out, record)
            print(f"gpu pass: {section.name}: {status} ({seconds:.0f} s)", flush=True)
    print(markdown(record))
    print(f"gpu pass: wrote {out}/gpu_pass.json, gpu_pass.md, {LOG_NAME}", flush=True)
    return 0 if all(e["status"] == "ok" for e in record["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
