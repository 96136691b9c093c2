"""The report of a sweep: report.md and PNG plots in the sweep directory, and the same
tables and images in the sweep's W&B group.

Each experiment module (``experiments/<name>.py``) provides ``CLAIMS`` (claims.Claim by
key), ``report(jobs) -> list[Table]`` and ``plots(jobs) -> dict[name, Figure]``.
"""

from __future__ import annotations

import datetime
import importlib
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from experiments import parts, records
from experiments.claims import Table, claims_table
from experiments.sweep import Job, experiment_of, load_jobs
from llm.errors import ConfigError
from llm.launch.launcher import resolve_wandb_mode

DOCS = Path(__file__).resolve().parent.parent / "docs" / "experiments"
EXPERIMENTS = (
    "zero_memory",
    "grad_accumulation",
    "activation_recompute",
    "parallel_strategies",
    "mixed_precision",
    "optimizers",
    "flash_attention",
    "moe",
    "quantization",
    "kv_cache",
    "fp8",
)


def experiment_module(config: str):
    """The module of an experiment config: ``zero_memory_gpu`` -> experiments.zero_memory,
    ``optimizers_medium`` and ``optimizers_sharded`` -> experiments.optimizers."""
    name = config.removesuffix("_gpu").removesuffix("_medium").removesuffix("_sharded")
    if name not in EXPERIMENTS:
        raise ConfigError(f"no experiment named {name}; choose one of {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"experiments.{name}")


def jobs_table(jobs: list[Job]) -> Table:
    rows = []
    for j in jobs:
        status = f"FAILED: {j.error}" if j.failed else "ok"
        loss = None if j.failed else j.summary.get("final_train_loss")
        rows.append((j.num, j.label, status, "-" if loss is None else f"{loss:.4f}"))
    return Table("Jobs", ("job", "overrides", "status", "final train loss"), rows)


def markdown(table: Table) -> str:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = [f"### {table.title}", ""]
    if table.note:
        lines += [table.note, ""]
    lines.append("| " + " | ".join(table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def _device(jobs: list[Job]) -> str:
    for j in jobs:
        if not j.failed:
            hw = j.summary.get("hardware") or {}
            return hw.get("gpu") or f"CPU: {hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} cores)"
    return "unknown (no job finished)"


def verdicts_line(tables: list[Table]) -> str:
    """The report's key to its verdicts; the derived ones where a derived table is there."""
    line = (
        "- Verdicts: holds / does not hold (outside the claim's tolerance) / not comparable "
        "here (with the reason). ratio = ours / paper (a range's midpoint; an open range's "
        "lower bound)."
    )
    if any(t.derived for t in tables):
        line += (
            " Derived tables (arithmetic, no run behind them): formula agrees / formula "
            "disagrees, never holds."
        )
    return line


def _records_lines(sweep_dir: Path, config: str, plan: dict | None) -> list[str]:
    """A records folder's head: jobs in of those planned, and the scale's choices (the
    config's opening comment)."""
    if plan is None:
        return []
    k, n, pending = records.completeness(sweep_dir, None)
    more = "; the follow-up sweeps are still to be asked for" if pending else ""
    notes = " ".join(parts.scale_notes(config))
    return [
        f"- Jobs recorded: {k} of {n} planned{more}. A claim whose jobs are not all in "
        f'says "{records.NOT_ENOUGH} (k of n)" in place of a verdict.',
        f"- Scale (conf/experiment/{config}.yaml): {notes}",
    ]


def write_report(sweep_dir: Path, log_wandb: bool = True) -> Path:
    sweep_dir = Path(sweep_dir)
    config = experiment_of(sweep_dir)
    if config is None:
        raise ConfigError(
            f"{sweep_dir} has no multirun.yaml naming an experiment; pass the directory "
            "`python -m experiments run` made (multirun/experiments/NAME/...)"
        )
    module = experiment_module(config)
    jobs = load_jobs(sweep_dir)
    tables = [jobs_table(jobs), claims_table(module.CLAIMS), *module.report(jobs)]
    plan = records.read_plan(sweep_dir)
    if plan is not None:  # a records folder: verdicts wait for their claims' jobs
        tables = records.withhold(sweep_dir, tables, parts.claim_parts_of(config))
    images = {}
    for name, fig in module.plots(jobs).items():
        path = sweep_dir / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        images[name] = path
    failed = sum(j.failed for j in jobs)
    head = [
        f"# Experiment `{config}`",
        "",
        (module.__doc__ or "").strip(),
        "",
        f"- Sweep: `{sweep_dir}`",
        f"- Device: {_device(jobs)}",
        f"- Jobs: {len(jobs)}, failed: {failed}",
        f"- Written: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        verdicts_line(tables),
        *_records_lines(sweep_dir, config, plan),
        "",
    ]
    body = [markdown(t) for t in tables]
    pics = [f"![{name}]({path.name})\n" for name, path in images.items()]
    out = sweep_dir / "report.md"
    out.write_text("\n".join(head + body + pics))
    if log_wandb:
        log_to_wandb(sweep_dir, jobs, tables, images)
    return out


def _wandb_target(sweep_dir: Path, jobs: list[Job]) -> dict | None:
    """Where the jobs logged: project, entity, group (the sweep's), mode; None: no W&B."""
    logger = next((j.get("logger") for j in jobs if j.get("logger")), None)
    if not logger or logger.get("name") != "wandb":
        return None
    mode = resolve_wandb_mode(logger.get("mode", "auto"))
    if mode == "disabled":
        return None
    group = next(
        (j.summary["wandb"]["group"] for j in jobs if not j.failed and "wandb" in j.summary),
        None,
    )
    # train.py names a sweep's group after Hydra's sweep.dir, "/" -> "_".
    return {
        "project": logger.get("project"),
        "entity": logger.get("entity"),
        "group": group or str(sweep_dir).replace("/", "_"),
        "mode": mode,
    }


def log_to_wandb(sweep_dir: Path, jobs: list[Job], tables: list[Table], images: dict) -> None:
    target = _wandb_target(sweep_dir, jobs)
    if target is None:
        return
    import wandb

    run = wandb.init(
        project=target["project"],
        entity=target["entity"],
        group=target["group"],
        name=f"{target['group']}/report",
        job_type="report",
        dir=str(sweep_dir),
        mode=target["mode"],
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        for t in tables:
            rows = [[str(v) for v in row] for row in t.rows]
            run.log({t.key: wandb.Table(columns=list(t.columns), data=rows)})
        for name, path in images.items():
            run.log({name: wandb.Image(str(path))})
    finally:
        run.finish()


def publish(sweep_dir: Path, docs: Path = DOCS) -> Path:
    """Copy the sweep's report.md and PNGs to docs/experiments/<config>/, replacing the
    previous ones: the committed report of that experiment and scale."""
    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / "report.md").exists():
        raise ConfigError(f"{sweep_dir} has no report.md; run `python -m experiments report` first")
    if records.read_plan(sweep_dir) is not None:
        return _publish_records(sweep_dir, docs)
    dest = docs / experiment_of(sweep_dir)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in [sweep_dir / "report.md", *sorted(sweep_dir.glob("*.png"))]:
        shutil.copy2(f, dest / f.name)
    return dest / "report.md"


def _publish_records(sweep_dir: Path, docs: Path) -> Path:
    """A records folder goes to docs/experiments/<config>/ whole (records, plan, report),
    refused where a record came from a tree with uncommitted changes."""
    why = records.not_publishable(sweep_dir)
    if why:
        raise ConfigError(why)
    dest = docs / experiment_of(sweep_dir)
    if dest.resolve() != sweep_dir.resolve():
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(sweep_dir, dest)
    return dest / "report.md"
