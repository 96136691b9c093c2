"""Train a language model: `python train.py [group=option ...] [key=value ...]`.

Hydra composes conf/config.yaml with the command line; the result is checked against the
typed schemas in llm/config/ and by llm/validate/ before any rank starts, then
llm/launch/launcher.py runs it (spawning local ranks, or as one rank of torchrun / Slurm /
deepspeed).
Before Hydra runs, the signal guard is installed (a signal at any moment stops the run
with a checkpoint), override keys are checked for typos, the run directory's folder for
write access and its disk for room, so none of these ends in a traceback or leaves a folder
behind.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from llm.config import register_configs, to_dataclass
from llm.errors import Interrupted, LabError

if TYPE_CHECKING:
    from llm.parallel.dist import RankEnv

register_configs()
# Absolute: Hydra finds it however this file is loaded (as a script, or by path in tests).
CONF = str(Path(__file__).resolve().parent / "conf")
# Each job of this process's sweep (Hydra's basic launcher runs them here), for the table
# printed when the sweep ends.
JOBS: list[dict] = []


def _run_record(dict_cfg: DictConfig) -> dict[str, str]:
    """The .hydra files Hydra would have written (conf: hydra.output_subdir=null), for the
    launcher to write once it holds the run directory's lock."""
    hydra_cfg = HydraConfig.get()
    return {
        "config.yaml": OmegaConf.to_yaml(dict_cfg),
        "hydra.yaml": OmegaConf.to_yaml({"hydra": hydra_cfg}),
        "overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task)),
    }


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
@record  # under torchrun, a rank's traceback reaches torchrun's failure report
def main(dict_cfg: DictConfig) -> float | None:
    """One job: every line it shows, and every record it logs, also lands in its run
    directory's train.log, prefixed with the rank that wrote it (docs/design.md)."""
    from llm.launch.launcher import external_rank_env
    from llm.logging import run_log

    env = external_rank_env()
    if env is not None:
        who = f"rank {env.rank}"
    else:  # one local rank runs in this process; more are spawned, and it launches them
        who = "rank 0" if dict_cfg.launcher.nproc_per_node == 1 else "launcher"
    with run_log(Path(HydraConfig.get().runtime.output_dir), who):
        return _job(dict_cfg, env)


def _job(dict_cfg: DictConfig, env: RankEnv | None) -> float | None:
    from llm.estimate.startup import announce_estimate
    from llm.launch.cli_report import print_run_end, remove_unused_run_dir
    from llm.launch.launcher import launch, stopped_message
    from llm.logging import say
    from llm.validate import validate

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun:
        # One W&B group per sweep: the sweep directory names it.
        dict_cfg.sweep_name = hydra_cfg.sweep.dir.replace("/", "_")
    run_dir = Path(hydra_cfg.runtime.output_dir)
    job = {"dir": run_dir, "overrides": " ".join(hydra_cfg.overrides.task), "summary": None}
    JOBS.append(job)
    try:
        cfg = to_dataclass(dict_cfg)
        validate(cfg, world_size=env.world_size if env else None, rank_env=env)
        if env is None or env.rank == 0:
            announce_estimate(cfg, env.world_size if env else cfg.launcher.nproc_per_node)
        try:
            summary = launch(cfg, record=_run_record(dict_cfg))
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
            raise Interrupted(
                f"{stopped_message(cfg, 'SIGINT')} (stopped at once by a second Ctrl-C)"
            ) from None
    except LabError as exc:
        # One line naming the problem and the fix, not a traceback; torchrun's report
        # shows the same line (its error file).
        get_error_handler().record_exception(exc)
        label = "stopped" if isinstance(exc, Interrupted) else "error"
        job["status"] = f"{label}: {exc}"
        if not isinstance(exc, Interrupted) and not multirun:
            # A refused config leaves no empty folder (a sweep keeps its job's folder: the
            # sweep's record of that job).
            remove_unused_run_dir(run_dir)
        say(f"{label}: {exc}", logging.WARNING if isinstance(exc, Interrupted) else logging.ERROR)
        raise SystemExit(exc.exit_code) from None
    job["summary"] = summary
    if env is None or env.rank == 0:
        print_run_end(summary, Path(cfg.output_dir))
    # Returned for sweepers (e.g. Optuna) that minimise the objective.
    return summary.get("final_val_loss")


def cli(argv: list[str]) -> int:
    """train.py's command line: the exit status. Signals are recorded from the start (the
    terminal's owner says at once what happens next); typos in override keys, a run
    directory that cannot be written and a full disk are refused in one line before Hydra
    writes anything."""
    from llm.launch.cli_report import print_sweep_table
    from llm.launch.launcher import external_rank_env, strip_launcher_args
    from llm.logging import say
    from llm.runfiles.preflight import check_disk, check_override_keys, check_run_dir_writable
    from llm.train.stop import exit_code, stop_guard

    env = external_rank_env()
    # The deepspeed launcher appends --local_rank=N, which Hydra would reject as an override.
    argv = strip_launcher_args(argv)
    with stop_guard(announce=env is None or env.rank == 0):
        try:
            check_override_keys(argv)
            check_run_dir_writable(argv)
            check_disk(argv)
        except LabError as exc:
            say(f"error: {exc}", logging.ERROR)
            return exc.exit_code
        sys.argv = [sys.argv[0], *argv]
        try:
            main()
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:  # a second Ctrl-C before the run began
            say("stopped: interrupted (Ctrl-C) before the run began", logging.WARNING)
            return exit_code("SIGINT")
        finally:
            if len(JOBS) > 1:
                print_sweep_table(JOBS)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
