"""A Hydra sweep directory as the report reads it: one :class:`Job` per numbered job folder
(its overrides, composed config, summary.json and metrics.jsonl)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

ERROR_FILE = "error.txt"  # written by `python -m experiments run` when a job fails


@dataclass
class Job:
    num: str  # the job's folder under the sweep: "17", or "follow_up_1/0"
    dir: Path
    overrides: list[str]
    config: dict
    summary: dict | None
    metrics: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.summary is None

    @property
    def label(self) -> str:
        swept = [o for o in self.overrides if not o.startswith("experiment=")]
        return " ".join(swept) or f"job {self.num}"

    def get(self, dotted: str, default=None):
        """A value of the job's composed config, e.g. ``parallelism.name``."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def attention_backend(self) -> str:
        """The attention kernel the run used: attention=auto's pick (summary.json's
        ``attention``), else the configured backend."""
        picked = ((self.summary or {}).get("attention") or {}).get("backend")
        return picked or self.get("attention.backend", "sdpa")

    def override(self, key: str) -> str | None:
        """The value this job's sweep gave ``key`` (``parallelism=zero2`` -> ``zero2``)."""
        for o in self.overrides:
            k, _, v = o.partition("=")
            if k.lstrip("+~") == key:
                return v
        return None

    def metric(self, key: str) -> list[tuple[int, float]]:
        """(step, value) for every metrics.jsonl row that has ``key``."""
        return [(m["step"], m[key]) for m in self.metrics if m.get(key) is not None]


def _read_yaml(path: Path):
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.exists() else None


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last row (the job was killed mid-write)
    return rows


def _error(job_dir: Path) -> str | None:
    path = job_dir / ERROR_FILE
    if path.exists():
        return path.read_text().strip() or None
    ranks = sorted((job_dir / ".rank_errors").glob("rank*.txt"))
    return ranks[0].read_text().strip().splitlines()[0] if ranks else None


def load_job(job_dir: Path, num: str | None = None) -> Job:
    hydra = job_dir / ".hydra"
    summary_path = job_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return Job(
        num=num or job_dir.name,
        dir=job_dir,
        overrides=_read_yaml(hydra / "overrides.yaml") or [],
        config=_read_yaml(hydra / "config.yaml") or {},
        summary=summary,
        metrics=_metrics(job_dir / "metrics.jsonl"),
        error=None if summary is not None else (_error(job_dir) or "no summary.json written"),
    )


FOLLOW_UP = "follow_up_"  # the sub-sweeps an experiment adds after its own (follow_up_1, ...)


def load_jobs(sweep_dir: Path) -> list[Job]:
    """The sweep's jobs, then those of its follow-up sweeps in the order they ran."""
    sweep_dir = Path(sweep_dir)
    follow_ups = sorted(
        (d for d in sweep_dir.glob(f"{FOLLOW_UP}*") if d.name.removeprefix(FOLLOW_UP).isdigit()),
        key=lambda d: int(d.name.removeprefix(FOLLOW_UP)),
    )
    jobs = []
    for folder in (sweep_dir, *follow_ups):
        dirs = [d for d in folder.iterdir() if d.is_dir() and d.name.isdigit()]
        for d in sorted(dirs, key=lambda d: int(d.name)):
            jobs.append(load_job(d, str(d.relative_to(sweep_dir))))
    return jobs


def experiment_of(sweep_dir: Path) -> str | None:
    """The experiment config the sweep ran (``zero_memory`` or ``zero_memory_gpu``)."""
    multirun = _read_yaml(Path(sweep_dir) / "multirun.yaml") or {}
    choice = multirun.get("hydra", {}).get("runtime", {}).get("choices", {}).get("experiment")
    if choice:
        return choice
    for o in multirun.get("hydra", {}).get("overrides", {}).get("task", []):
        if o.startswith("experiment="):
            return o.split("=", 1)[1]
    return None
