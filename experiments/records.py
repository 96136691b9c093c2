"""Job records: a finished job of a recorded run (``python -m experiments run NAME
scale=gpu --out DIR`` or ``--resume DIR``), kept so that later short GPU runs can add the
missing jobs and the report can be written from whatever is in.

DIR has the shape of a sweep folder, so ``load_jobs`` and ``write_report`` read it as one:
``DIR/<num>/`` (``follow_up_<n>/<num>/`` for follow-ups) holds the job's light files
(summary.json, metrics.jsonl, .hydra/*.yaml, error.txt, and the small JSON files the report
caches beside a job, e.g. kv_cache.json) and ``record.json``: the job's overrides, the
device, and the commit it ran from (sha, dirty flag, source: git or the ``.gpu_pass_commit``
stamp) with the sha256 of every file the job and the report depend on and one digest over
them (benchmarks/gpu_pass/provenance.py). ``DIR/plan.json`` holds the planned jobs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.gpu_pass import provenance
from experiments.sweep import ERROR_FILE, FOLLOW_UP

RECORD = "record.json"
PLAN = "plan.json"
MARKER = "multirun.yaml"  # names the experiment, as a Hydra sweep folder does
KEPT = (
    "summary.json",
    "metrics.jsonl",
    ERROR_FILE,
    ".hydra/overrides.yaml",
    ".hydra/config.yaml",
    ".hydra/hydra.yaml",
)
CACHE_LIMIT = 1 << 20  # a report's cached measurement is a few KiB; checkpoints stay out
NOT_ENOUGH = "not enough jobs yet"


def identity(overrides: list[str]) -> frozenset[str]:
    """What names a job: its overrides, less Hydra's own settings (where it wrote)."""
    return frozenset(o for o in overrides if not o.lstrip("+~").startswith("hydra."))


def job_label(overrides: list[str]) -> str:
    return " ".join(sorted(identity(overrides))) or "(no overrides)"


def read_record(job_dir: Path) -> dict | None:
    path = job_dir / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def code_files(config: str, hydra_choices: dict) -> list[str]:
    """The repository files a job and its report depend on: the modules this process has
    imported (llm, experiments), train.py, and the config files the job composed."""
    conf = [f"conf/experiment/{config}.yaml", "conf/config.yaml", "train.py"]
    name = config.removesuffix("_gpu").removesuffix("_medium").removesuffix("_sharded")
    conf.append(f"conf/experiment/{name}.yaml")
    for group, choice in hydra_choices.items():
        if isinstance(choice, str) and not group.startswith("hydra"):
            conf.append(f"conf/{group}/{choice}.yaml")
    present = [c for c in conf if (provenance.REPO / c).is_file()]
    return sorted(set(provenance.module_files()) | set(present))


def _choices(job_dir: Path) -> dict:
    from omegaconf import OmegaConf

    path = job_dir / ".hydra" / "hydra.yaml"
    if not path.exists():
        return {}
    return (
        OmegaConf.to_container(OmegaConf.load(path))
        .get("hydra", {})
        .get("runtime", {})
        .get("choices", {})
    )


def _device(summary: dict | None) -> str:
    if summary is None:
        return "unknown (the job failed)"
    hw = summary.get("hardware") or {}
    return hw.get("gpu") or f"CPU: {hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} cores)"


def write_record(
    job_dir: Path, dest: Path, config: str, overrides: list[str], tree: provenance.Tree
) -> dict:
    """Copy the job's light files from its run folder to ``dest`` with its record; ``dest``
    appears whole or not at all (a run killed mid-copy leaves only a dot folder)."""
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel in KEPT:
        if (job_dir / rel).exists():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(job_dir / rel, tmp / rel)
    for cached in job_dir.glob("*.json"):
        if cached.name not in KEPT and cached.stat().st_size <= CACHE_LIMIT:
            tmp.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, tmp / cached.name)
    tmp.mkdir(parents=True, exist_ok=True)
    summary_path = job_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    files = provenance.hashes(code_files(config, _choices(job_dir)))
    record = {
        "experiment": config,
        "job": sorted(identity(overrides)),
        "failed": summary is None,
        "device": _device(summary),
        "commit": tree.record(),
        "provenance": {"digest": provenance.digest(files), "files": files},
    }
    (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return record


def job_dirs(out: Path) -> list[Path]:
    """Every recorded job folder: ``<num>`` and ``follow_up_<n>/<num>``."""
    found = [d for d in out.glob("*") if d.is_dir() and d.name.isdigit()]
    found += [d for d in out.glob(f"{FOLLOW_UP}*/*") if d.is_dir() and d.name.isdigit()]
    return [d for d in found if (d / RECORD).exists()]


def code_changed(job_dir: Path) -> str | None:
    """Why a finished job's record cannot stand beside jobs run from this tree (its code
    differs here), naming the job and the files; None where it can."""
    record = read_record(job_dir)
    if record is None or record["failed"]:
        return None  # a failed job runs again anyway
    why = provenance.changed_since(record)
    if why is None:
        return None
    sha = record["commit"].get("sha") or "an unknown commit"
    return (
        f"{job_dir.name} ({job_label(record['job'])}) was recorded at {sha[:12]} and {why}; "
        f"remove {job_dir} to run it again here, or resume from a checkout of that commit"
    )


def not_publishable(out: Path) -> str | None:
    """Why the records in ``out`` may not be published: a job run from a tree with
    uncommitted changes, or from an unknown commit. None where every record names a clean
    commit."""
    for d in sorted(job_dirs(out)):
        commit = read_record(d)["commit"]
        if commit.get("sha") is None or commit.get("dirty") is not False:
            state = "an unknown commit" if commit.get("sha") is None else "uncommitted changes"
            return (
                f"{d} was recorded from a tree with {state}; run it again from a "
                "committed tree (make gpu-stamp on a copy without .git) before publishing"
            )
    return None


def read_plan(out: Path) -> dict | None:
    path = Path(out) / PLAN
    return json.loads(path.read_text()) if path.exists() else None


def _finished(out: Path) -> dict[str, frozenset[str]]:
    """Each finished recorded job's folder (relative to ``out``) and identity."""
    out = Path(out)
    done = {}
    for d in job_dirs(out):
        record = read_record(d)
        if not record["failed"]:
            done[d.relative_to(out).as_posix()] = identity(record["job"])
    return done


def completeness(out: Path, needs: tuple[str, ...] | None) -> tuple[int, int, bool]:
    """(finished, planned, follow-ups pending) over the jobs of the parts ``needs`` names
    (None: every part and the follow-ups)."""
    plan = read_plan(out)
    finished = set(_finished(out).values())
    planned = [identity(j) for j in plan["jobs"]]
    if needs is not None:
        nums = {n for part in needs for n in plan["parts"].get(part, [])}
        planned = [planned[n] for n in sorted(nums)]
    else:
        planned += [identity(j) for jobs in plan["follow_ups"].values() for j in jobs]
    pending = needs is None and not plan["follow_ups_done"]
    return sum(p in finished for p in planned), len(planned), pending


def withhold(out: Path, tables: list, claim_parts: dict[str, tuple[str, ...]]) -> list:
    """The report's tables with "not enough jobs yet (k of n)" in place of the verdict of
    every measured row whose claim's jobs are not all in. ``claim_parts``: the parts a claim
    needs (every part and the follow-ups where it is not named). Derived tables are
    arithmetic with no job behind them and stay as they are."""
    if read_plan(out) is None:
        return tables
    for table in tables:
        if table.derived or "verdict" not in table.columns:
            continue
        rows = []
        for row in table.rows:
            k, n, pending = completeness(out, claim_parts.get(row[0]))
            if k < n or pending:
                more = ", follow-ups pending" if pending else ""
                row = (*row[:-1], f"{NOT_ENOUGH} ({k} of {n}{more})")
            rows.append(row)
        table.rows = rows
    return tables
