"""Running an experiment: Hydra's multirun of ``conf/experiment/<config>.yaml`` in this
process, through train.py's own task function, with one difference from
``python train.py -m``: a job that fails is recorded (``error.txt`` in its folder) and the
sweep goes on, so the report can mark it. (train.py ends a failed run with SystemExit, which
Hydra's launcher does not catch: the remaining jobs would never run.)"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from experiments.sweep import ERROR_FILE, FOLLOW_UP, load_jobs
from llm.config import register_configs
from llm.errors import ConfigError
from llm.train.stop import STOP_CODES

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
# medium: a longer CPU run, sharded: the same under sharded strategies, where an experiment
# has them
SCALES = ("small", "medium", "gpu", "sharded")
REQUIRED_SCALES = ("small", "gpu")


class JobFailed(Exception):
    """A job of the sweep failed; Hydra records it and runs the next one."""


class SweepInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped a job (train.py saved its checkpoint): no later job runs."""

    def __init__(self, sweep_dir: Path | None) -> None:
        super().__init__(f"the sweep in {sweep_dir} was interrupted")
        self.sweep_dir = sweep_dir


def config_file(name: str, scale: str) -> Path:
    """The experiment config of a scale: ``<name>.yaml`` (small) or ``<name>_<scale>.yaml``."""
    return CONF / "experiment" / f"{name if scale == 'small' else f'{name}_{scale}'}.yaml"


def scales_of(name: str) -> list[str]:
    return [s for s in SCALES if config_file(name, s).exists()]


def config_name(name: str, scale: str) -> str:
    if scale not in SCALES:
        raise ConfigError(f"scale={scale} is not one of {', '.join(SCALES)}; use one of them")
    if scale not in scales_of(name):
        raise ConfigError(
            f"experiment {name} has no {scale} scale ({config_file(name, scale)}); "
            "`python -m experiments list` shows what exists"
        )
    return config_file(name, scale).stem


def _train_module():
    # train.py is the entry script, not a package module: load it by path.
    spec = importlib.util.spec_from_file_location("train", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Tee(io.TextIOBase):
    """stderr as it was, plus a copy: train.py prints a failed run's one-line reason there."""

    def __init__(self, stream) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()  # faulthandler (torchrun's error handler) writes there


def _reason(stderr: str, fallback: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith(("error:", "stopped:"))]
    return lines[-1] if lines else fallback


def run_sweep(config: str, overrides: list[str]) -> Path | None:
    """Run the sweep; returns its directory (None if Hydra stopped before making one).
    Raises SweepInterrupted when a job was interrupted."""
    train = _train_module()
    register_configs()  # train.py registers them on import; a stand-in module does not
    state: dict = {}

    @hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
    def job(cfg: DictConfig):
        out = Path(HydraConfig.get().runtime.output_dir)
        state["sweep_dir"] = Path(HydraConfig.get().sweep.dir)
        tee = _Tee(sys.stderr)
        try:
            with contextlib.redirect_stderr(tee):
                # Hydra's decorator passes a given cfg straight on. A job a signal stopped
                # (Ctrl-C, or Slurm's SIGTERM) checkpointed and exits 130 or 143.
                return train.main(cfg)
        except SystemExit as exc:
            if exc.code in (0, None):
                return None
            if exc.code in STOP_CODES:
                raise  # not a failed job: a signal stops the sweep
            reason = _reason(tee.copy.getvalue(), f"exit status {exc.code}")
        except Exception as exc:  # any failure is recorded; the sweep goes on
            reason = f"{type(exc).__name__}: {exc}"
        (out / ERROR_FILE).write_text(reason + "\n")
        raise JobFailed(reason)

    argv = sys.argv
    sys.argv = ["experiments", "-m", f"experiment={config}", *overrides]
    try:
        job()
    except SystemExit as exc:
        # Hydra exits after the sweep when a job failed (the report marks it), or at once
        # when a job was interrupted.
        if exc.code in STOP_CODES:
            raise SweepInterrupted(state.get("sweep_dir")) from None
    finally:
        sys.argv = argv
    return state.get("sweep_dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def run_follow_ups(module, config: str, overrides: list[str], sweep_dir: Path) -> None:
    """Sweeps the experiment asks for after reading its jobs (``module.follow_up(jobs)``:
    a list of override lists, or nothing more), each into ``SWEEP/follow_up_<n>`` (n after
    the ones already there), until it asks for none. The command line's overrides stay, less the keys a follow-up sets."""
    follow_up = getattr(module, "follow_up", None)
    n = len(list(Path(sweep_dir).glob(f"{FOLLOW_UP}*")))  # a grown sweep goes on numbering
    while follow_up is not None and (more := follow_up(load_jobs(sweep_dir))):
        for extra in more:
            n += 1
            keys = {_key(o) for o in extra}
            kept = [o for o in overrides if _key(o) not in keys]
            target = f"hydra.sweep.dir={sweep_dir}/{FOLLOW_UP}{n}"
            try:
                run_sweep(config, [*kept, *extra, target])
            except SweepInterrupted:
                raise SweepInterrupted(sweep_dir) from None  # the report covers the whole


def sweep_params(config: str) -> dict:
    """The config's ``hydra.sweeper.params``."""
    register_configs()  # the schemas the option files extend
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", [f"experiment={config}"], return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.sweeper.params or {})


def expand(params: dict, overrides: list[str] = ()) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands ``params`` and the command
    line's overrides (a key given on the command line replaces the config's)."""
    parsed = OverridesParser.create().parse_overrides(
        [f"{k}={v}" for k, v in params.items()] + list(overrides)
    )
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def sweep_jobs(config: str, overrides: list[str] = ()) -> list[list[str]]:
    """Each job's overrides in the sweep of ``config`` with the command line's
    ``overrides``."""
    return expand(sweep_params(config), overrides)


def compose_jobs(
    config: str, jobs: list[list[str]], output_dir: str = "/tmp/experiments-dry-run"
) -> list[DictConfig]:
    """Each job's composed config, as the multirun composes it (dry runs; outside a Hydra
    run, output_dir is given instead of Hydra's job directory)."""
    register_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return [
            compose("config", [f"experiment={config}", *job, f"output_dir={output_dir}"])
            for job in jobs
        ]
