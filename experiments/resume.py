"""A recorded run: ``python -m experiments run NAME scale=gpu [part=P] --out DIR [--resume
DIR0]``. Each job runs as a one-job Hydra sweep in a scratch folder (checkpoints stay
there); when it ends, its record goes to DIR (experiments/records.py). With ``--resume``,
the records already in DIR0 are kept (copied to DIR first where it is another folder) and
only the planned jobs without a finished record run; a record whose code differs from this
tree's is refused. Follow-up sweeps run once every job of the sweep is in (``part`` left
out, or ``part=follow_ups``)."""

from __future__ import annotations

import datetime
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu_pass import provenance
from experiments import records
from experiments.gpu_plan import multi_gpu_commands
from experiments.parts import FOLLOW_UPS, gpus_for, gpus_needed, part_overrides, parts_of
from experiments.report import experiment_module
from experiments.runner import REPO, SweepInterrupted, expand, run_sweep, sweep_params
from experiments.sweep import FOLLOW_UP, load_job, load_jobs
from llm.errors import ConfigError

# (config, the job's overrides, a scratch folder) -> the folder the job wrote
JobRunner = Callable[[str, list[str], Path], Path]


def run_in_hydra(config: str, job: list[str], scratch: Path) -> Path:
    """The job as a one-job sweep of train.py (its overrides fix every swept key), then
    the report's measurements of it (kv_cache, quantization), cached in its folder."""
    kept = [o for o in job if not o.startswith("hydra.sweep.dir=")]
    run_sweep(config, [*kept, f"hydra.sweep.dir={scratch}"])
    job_dir = scratch / "0"
    try:
        experiment_module(config).report([load_job(job_dir, "0")])
    except Exception as exc:  # the record goes without the cache; the next jobs still run
        print(f"note: the report's measurement of {scratch} failed: {exc}", file=sys.stderr)
    return job_dir


def refuse_too_few_gpus(config: str, overrides: list[str], have: int | None = None) -> None:
    """An experiment that needs several GPUs (``# needs GPUS:`` in its config) is refused
    on a machine with fewer, with the commands for each GPU count the config names
    (experiments/gpu_plan.py): one rank stands in for none of its claims. ``overrides``
    include the part's."""
    if not gpus_needed(config):
        return
    need = gpus_for(config, overrides)
    if have is None:
        import torch

        have = torch.cuda.device_count()
    if have >= need:
        return
    commands = multi_gpu_commands(config.removesuffix("_gpu"))
    on = [f"on {n} GPUs: {cmds}" for n, cmds in commands.items()]
    raise ConfigError(
        f"{config} needs {need} GPUs (one rank per GPU) and this machine has {have}; "
        + ", ".join(on)
    )


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


class Recorder:
    """Runs the missing jobs of one experiment config into ``out``."""

    def __init__(self, config: str, overrides: list[str], out: Path, run_job: JobRunner):
        self.config, self.overrides, self.out, self.run_job = config, overrides, out, run_job
        stamp = f"{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
        self.scratch = REPO / "multirun" / "experiments" / config / f"recorded_{stamp}"
        self.tree = provenance.current(skip=(out,))  # records written there leave it clean
        self.params = sweep_params(config)  # composed once: each expansion reuses it

    def _save_plan(self, plan: dict) -> None:
        (self.out / records.PLAN).write_text(json.dumps(plan, indent=1) + "\n")

    def plan(self) -> dict:
        """The sweep's jobs, numbered as Hydra numbers them, each part's job numbers, and
        the follow-up sweeps asked for so far. A folder planned from another sweep is
        refused."""
        jobs = [sorted(records.identity(j)) for j in expand(self.params, self.overrides)]
        earlier = records.read_plan(self.out)
        if earlier is not None and (earlier["config"], earlier["jobs"]) != (self.config, jobs):
            raise ConfigError(
                f"{self.out} holds records of another sweep ({earlier['config']}, "
                f"{len(earlier['jobs'])} jobs; this one {self.config}, {len(jobs)}): give "
                "the same overrides as before, or a fresh --out folder"
            )
        plan = earlier or {
            "config": self.config,
            "jobs": jobs,
            "follow_ups": {},
            # an experiment without follow-ups has none to wait for
            "follow_ups_done": not hasattr(experiment_module(self.config), "follow_up"),
        }
        index = {frozenset(j): n for n, j in enumerate(jobs)}
        plan["parts"] = {
            name: sorted(
                index[records.identity(j)]
                for j in expand(self.params, [*self.overrides, *narrowing])
            )
            for name, narrowing in parts_of(self.config).items()
        }
        self._save_plan(plan)
        return plan

    def check(self, plan: dict) -> None:
        """Refuse a record whose code differs here, or one in a folder planned for another
        job."""
        for d in records.job_dirs(self.out):
            why = records.code_changed(d)
            if why:
                raise ConfigError(why)
            rel = d.relative_to(self.out).as_posix()
            planned = self._planned(plan).get(rel)
            recorded = records.identity(records.read_record(d)["job"])
            if planned is not None and records.identity(planned) != recorded:
                raise ConfigError(
                    f"{d} records {records.job_label(sorted(recorded))}, but the sweep's job "
                    f"{rel} is {records.job_label(planned)}: use a fresh --out folder"
                )

    @staticmethod
    def _planned(plan: dict) -> dict[str, list[str]]:
        out = {str(n): j for n, j in enumerate(plan["jobs"])}
        for n, jobs in plan["follow_ups"].items():
            out.update({f"{FOLLOW_UP}{n}/{i}": j for i, j in enumerate(jobs)})
        return out

    def _done(self, rel: str) -> bool:
        record = records.read_record(self.out / rel)
        return record is not None and not record["failed"]

    def _run(self, rel: str, job: list[str]) -> None:
        if self._done(rel):
            return
        scratch = self.scratch / rel.replace("/", "_")
        try:
            job_dir = self.run_job(self.config, job, scratch)
        except SweepInterrupted:
            raise SweepInterrupted(self.out) from None
        dest = self.out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        records.write_record(job_dir, dest, self.config, job, self.tree)

    def follow_ups(self, plan: dict) -> None:
        """The follow-up sweeps the experiment asks for, each job recorded, until it asks
        for none (or only for one it asked for before)."""
        follow_up = getattr(experiment_module(self.config), "follow_up", None)
        while True:
            for n, jobs in plan["follow_ups"].items():
                for i, job in enumerate(jobs):
                    self._run(f"{FOLLOW_UP}{n}/{i}", job)
            more = follow_up(load_jobs(self.out)) if follow_up else []
            asked = {frozenset(map(frozenset, js)) for js in plan["follow_ups"].values()}
            added = False
            for extra in more:
                keys = {_key(o) for o in extra}
                kept = [o for o in self.overrides if _key(o) not in keys]
                jobs = [sorted(records.identity(j)) for j in expand(self.params, kept + extra)]
                if frozenset(map(frozenset, jobs)) in asked:
                    continue
                plan["follow_ups"][str(len(plan["follow_ups"]) + 1)] = jobs
                added = True
            if not added:
                break
            self._save_plan(plan)
        plan["follow_ups_done"] = True
        self._save_plan(plan)

    def run(self, part: str | None) -> None:
        part_overrides(self.config, part)  # refuses a part the config does not name
        self.out.mkdir(parents=True, exist_ok=True)
        plan = self.plan()
        self.check(plan)
        (self.out / records.MARKER).write_text(
            f"hydra:\n  runtime:\n    choices:\n      experiment: {self.config}\n"
        )
        if part != FOLLOW_UPS:
            chosen = range(len(plan["jobs"])) if part is None else plan["parts"].get(part, [])
            for n in chosen:
                self._run(str(n), plan["jobs"][n])
        if part in (None, FOLLOW_UPS):
            missing = [n for n in range(len(plan["jobs"])) if not self._done(str(n))]
            if missing:
                if part == FOLLOW_UPS:
                    raise ConfigError(
                        f"{len(missing)} of the sweep's jobs are not in {self.out} yet (first: "
                        f"{missing[0]}); run the parts first, then part={FOLLOW_UPS}"
                    )
                return  # a job failed: the follow-ups wait for the whole sweep
            self.follow_ups(plan)


def run_recorded(
    config: str,
    overrides: list[str],
    out: Path,
    resume: Path | None = None,
    part: str | None = None,
    run_job: JobRunner = run_in_hydra,
) -> Path:
    """Run the missing jobs into ``out`` (the records of ``resume`` copied there first);
    returns ``out`` for the report."""
    out = Path(out)
    if resume is not None:
        resume = Path(resume)
        if not (resume / records.PLAN).exists():
            raise ConfigError(
                f"--resume {resume}: no {records.PLAN} there; give a folder an earlier "
                "recorded run wrote (--out), or leave --resume out"
            )
        if resume.resolve() != out.resolve():
            shutil.copytree(resume, out, dirs_exist_ok=True)
    Recorder(config, overrides, out, run_job).run(part)
    return out
