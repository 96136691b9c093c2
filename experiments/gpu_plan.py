"""What a reader runs to advance an experiment's GPU scale: ``python -m experiments list
--gpu``. Each step is one part of the sweep (the ``# part`` lines of its ``_gpu`` config;
the whole sweep where it has none), then ``part=follow_ups`` where the experiment grows its
sweep. Each command records into the committed folder ``docs/experiments/<config>/`` that
``publish`` writes, with ``--resume`` once that folder holds a plan, and with
``logger=none`` as scripts/gpu_session.sh runs it: a job's overrides name it in the plan,
so the two must agree. A config with ``# needs GPUS:`` gives each step the GPUs it needs
(``parts.gpus_for``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments import records
from experiments.parts import FOLLOW_UPS, claim_parts_of, gpus_for, gpus_needed, parts_of
from experiments.report import DOCS, experiment_module
from experiments.runner import config_name


@dataclass(frozen=True)
class Step:
    part: str | None  # None: the whole sweep
    command: str
    claims: tuple[str, ...]  # the claims this part's jobs alone judge (# claim lines)
    gpus: int  # 1 for a one-GPU experiment


def records_folder(config: str) -> str:
    """Where the records of ``config`` are committed, relative to the repository root."""
    return f"docs/experiments/{config}"


def command(name: str, part: str | None, resume: bool) -> str:
    out = records_folder(config_name(name, "gpu"))
    words = ["python -m experiments run", name, "scale=gpu"]
    words += [f"part={part}"] if part else []
    # a job's overrides name it in the records: logger=none as scripts/gpu_session.sh runs it
    words += ["logger=none", "--out", out] + (["--resume", out] if resume else [])
    return " ".join(words)


def steps(name: str, docs: Path = DOCS) -> list[Step]:
    """The parts of ``name``'s GPU scale in the order to run them, each with its command."""
    config = config_name(name, "gpu")
    module = experiment_module(config)
    resume = (docs / config / records.PLAN).exists()
    needs = claim_parts_of(config)
    parts = parts_of(config)
    if not parts:
        return [Step(None, command(name, None, resume), (), gpus_for(config, []))]
    found = [
        Step(
            part,
            command(name, part, resume),
            tuple(k for k, ps in needs.items() if part in ps),
            gpus_for(config, narrowing),
        )
        for part, narrowing in parts.items()
    ]
    if hasattr(module, "follow_up"):
        found.append(Step(FOLLOW_UPS, command(name, FOLLOW_UPS, resume), (), gpus_for(config, [])))
    return found


def recorded(config: str, docs: Path = DOCS) -> str:
    """How far the committed records of ``config`` are."""
    if records.read_plan(docs / config) is None:
        return f"no records yet ({records_folder(config)}/ has no {records.PLAN})"
    k, n, pending = records.completeness(docs / config, None)
    more = ", follow-ups pending" if pending else ""
    return f"{k} of {n} planned jobs recorded in {records_folder(config)}/{more}"


def multi_gpu_commands(name: str, docs: Path = DOCS) -> dict[int, str]:
    """For an experiment that needs several GPUs: the commands to run on each GPU count its
    config names (empty for a one-GPU experiment)."""
    config = config_name(name, "gpu")
    found = steps(name, docs)
    return {n: "; ".join(s.command for s in found if s.gpus <= n) for n in gpus_needed(config)}


def lines(name: str, docs: Path = DOCS) -> list[str]:
    """The listing of ``name``: where its records are, the claims that wait for every job,
    then each step's command (with the claims its jobs alone judge)."""
    config = config_name(name, "gpu")
    head = f"{name} ({config}): {recorded(config, docs)}"
    counts = gpus_needed(config)
    if counts:
        head += f"; needs {' or '.join(map(str, counts))} GPUs, one rank per GPU"
    found = steps(name, docs)
    alone = {c for s in found for c in s.claims}
    claims = experiment_module(config).CLAIMS.items()
    waiting = [k for k, c in claims if k not in alone and not c.derived]  # derived: no job
    out = [head, f"  claims judged once every step below is in: {', '.join(waiting)}"]
    for step in found:
        label = f"part {step.part}" if step.part else "the whole sweep"
        gpus = f", {step.gpus} GPUs" if counts else ""
        judged = f" (its jobs alone judge: {', '.join(step.claims)})" if step.claims else ""
        out += [f"  {label}{gpus}{judged}:", f"    {step.command}"]
    return out
