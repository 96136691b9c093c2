"""`python -m experiments run NAME [scale=small|gpu] [override ...]`: run an experiment's
sweep, then write its report. `python -m experiments report SWEEP_DIR`: (re)write the
report of a sweep. `python -m experiments list`: the experiments and their scales."""

from __future__ import annotations

import argparse
import sys

from experiments.report import EXPERIMENTS, write_report
from experiments.runner import config_name, run_sweep, scales_of
from llm.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment's sweep, then its report")
    run.add_argument("name", help=", ".join(EXPERIMENTS))
    run.add_argument("overrides", nargs="*", help="scale=small|gpu, then train.py overrides")
    report = sub.add_parser("report", help="write report.md and plots of a sweep directory")
    report.add_argument("sweep_dir")
    report.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
    sub.add_parser("list", help="the experiments and their scales")
    a = parser.parse_args(argv)
    try:
        if a.command == "list":
            for name in EXPERIMENTS:
                print(f"{name}: {', '.join(scales_of(name)) or 'no config'}")
            return 0
        if a.command == "report":
            print(write_report(a.sweep_dir, log_wandb=not a.no_wandb))
            return 0
        scale = "small"
        overrides = []
        for o in a.overrides:
            if o.startswith("scale="):
                scale = o.split("=", 1)[1]
            else:
                overrides.append(o)
        if a.name not in EXPERIMENTS:
            raise ConfigError(
                f"no experiment named {a.name}; choose one of {', '.join(EXPERIMENTS)}"
            )
        sweep_dir = run_sweep(config_name(a.name, scale), overrides)
        if sweep_dir is None:
            print("error: the sweep did not start (see Hydra's message above)", file=sys.stderr)
            return 1
        print(write_report(sweep_dir))
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
