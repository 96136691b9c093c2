"""`python -m experiments run NAME [scale=small|medium|gpu|sharded] [override ...]`: run an experiment's
sweep, then write its report. `... run NAME scale=gpu [part=P] --out DIR [--resume DIR0]`:
record each finished job in DIR, run only the jobs missing there, write the report from the
records (experiments/resume.py). `python -m experiments report SWEEP_DIR`: (re)write the
report of a sweep. `python -m experiments publish SWEEP_DIR`: copy its report.md and PNGs to
docs/experiments/<config>/. `python -m experiments list`: the experiments and their scales;
`... list --gpu`: each GPU part's command, the claims it feeds and the records so far
(experiments/gpu_plan.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments import gpu_plan
from experiments.parts import part_overrides
from experiments.report import EXPERIMENTS, experiment_module, publish, write_report
from experiments.resume import refuse_too_few_gpus, run_recorded
from experiments.runner import (
    SweepInterrupted,
    config_name,
    run_follow_ups,
    run_sweep,
    scales_of,
)
from experiments.sweep import experiment_of
from llm.errors import ConfigError, Interrupted


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment's sweep, then its report")
    run.add_argument("name", help=", ".join(EXPERIMENTS))
    run.add_argument(
        "overrides",
        nargs="*",
        help="scale=small|medium|gpu|sharded (medium, sharded: optimizers only), then "
        "train.py overrides",
    )
    run.add_argument("--publish", action="store_true", help="then copy it to docs/experiments/")
    run.add_argument(
        "--out",
        type=Path,
        help="record each finished job there (with part=NAME: only that part's jobs), and "
        "write the report there from the records",
    )
    run.add_argument(
        "--resume",
        type=Path,
        help="a folder of records (--out) to continue: only its missing jobs run",
    )
    report = sub.add_parser("report", help="write report.md and plots of a sweep directory")
    report.add_argument("sweep_dir")
    report.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
    report.add_argument("--publish", action="store_true", help="then copy it to docs/experiments/")
    grow = sub.add_parser(
        "grow",
        help="run the follow-up sweeps a stopped sweep still asks for (without the first "
        "command's overrides), then its report",
    )
    grow.add_argument("sweep_dir")
    grow.add_argument("--publish", action="store_true", help="then copy it to docs/experiments/")
    pub = sub.add_parser("publish", help="copy a sweep's report.md and PNGs to docs/experiments/")
    pub.add_argument("sweep_dir")
    names = sub.add_parser("list", help="the experiments and their scales")
    names.add_argument("--names", action="store_true", help="names only, one a line")
    names.add_argument(
        "--gpu",
        action="store_true",
        help="each experiment's GPU parts: the command of each, the claims it feeds, the "
        "records committed so far and, where several GPUs are needed, how many",
    )
    return parser


def split_args(args: list[str]) -> tuple[str, str | None, list[str]]:
    """``run``'s words after the name: (scale, part, the train.py overrides)."""
    scale, part = "small", None
    overrides = []
    for o in args:
        if o.startswith("scale="):
            scale = o.split("=", 1)[1]
        elif o.startswith("part="):
            part = o.split("=", 1)[1]
        else:
            overrides.append(o)
    return scale, part, overrides


def _run(name: str, args: list[str], out: Path | None = None, resume: Path | None = None):
    scale, part, overrides = split_args(args)
    if name not in EXPERIMENTS:
        raise ConfigError(f"no experiment named {name}; choose one of {', '.join(EXPERIMENTS)}")
    config = config_name(name, scale)
    refuse_too_few_gpus(config, [*part_overrides(config, part), *overrides])
    if out is not None or resume is not None:
        return run_recorded(config, overrides, out or resume, resume, part)
    if part is not None:
        raise ConfigError("part=NAME runs a part into a records folder: give --out DIR")
    sweep_dir = run_sweep(config, overrides)
    if sweep_dir is not None:
        run_follow_ups(experiment_module(config), config, overrides, sweep_dir)
    return sweep_dir


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    interrupted = False
    try:
        if a.command == "list" and a.gpu:
            for name in EXPERIMENTS:
                print("\n".join(gpu_plan.lines(name)))
            return 0
        if a.command == "list":
            for name in EXPERIMENTS:
                print(name if a.names else f"{name}: {', '.join(scales_of(name))}")
            return 0
        if a.command == "publish":
            print(publish(a.sweep_dir))
            return 0
        if a.command == "report":
            sweep_dir, log_wandb = a.sweep_dir, not a.no_wandb
        elif a.command == "grow":
            sweep_dir, log_wandb = Path(a.sweep_dir), True
            config = experiment_of(sweep_dir)
            if config is None:
                raise ConfigError(f"{sweep_dir} names no experiment; give a sweep's folder")
            try:
                run_follow_ups(experiment_module(config), config, [], sweep_dir)
            except SweepInterrupted:
                interrupted = True
        else:
            log_wandb = a.out is None and a.resume is None  # records: docs, not W&B
            try:
                sweep_dir = _run(a.name, a.overrides, a.out, a.resume)
            except SweepInterrupted as exc:
                sweep_dir, interrupted = exc.sweep_dir, True
            if sweep_dir is None:
                print("error: the sweep did not start (Hydra's message is above)", file=sys.stderr)
                return 1
        print(write_report(sweep_dir, log_wandb=log_wandb))
        if interrupted:
            print(
                "stopped: the sweep was interrupted; the report covers its jobs so far",
                file=sys.stderr,
            )
            return Interrupted.exit_code  # nothing published: the sweep is incomplete
        if a.publish:
            print(publish(sweep_dir))
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
