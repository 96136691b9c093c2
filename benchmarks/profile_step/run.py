"""Run the training step as train.py would, in this process, under the instruments.

The config is composed from train.py's overrides and the run built by llm.run (its own
builders, start to end); the tool only stands in for llm.run's Trainer with one whose
pieces are wrapped in profiler scopes, and drives the windows from its step:

- steps 1..warmup: warm-up (step 1 always probes memory, llm/train/probes.py);
- the next ``steps`` steps: under torch.profiler, nothing else installed;
- the next ``steps`` steps: host reads counted (a TorchFunctionMode costs a Python call per
  torch call, which would land in the profile as host time, so it runs apart);
- one last step, logged (its collected read and memory probe fall outside both windows).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch.profiler import ProfilerActivity, profile, record_function

import llm.run
import llm.train.trainer
from llm.config import Config, register_configs, to_dataclass
from llm.errors import ConfigError
from llm.launch.launcher import external_rank_env, launch
from llm.train.trainer import Trainer
from llm.validate import validate

from .host_reads import REPO, HostReads

CONF = REPO / "conf"


@dataclass(frozen=True)
class Plan:
    warmup: int
    steps: int

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.steps < 1:
            raise ConfigError("profile_step needs --warmup >= 1 (step 1 probes) and --steps >= 1")

    @property
    def profiled(self) -> range:
        return range(self.warmup + 1, self.warmup + self.steps + 1)

    @property
    def counted(self) -> range:
        return range(self.profiled.stop, self.profiled.stop + self.steps)

    @property
    def max_steps(self) -> int:
        return self.counted.stop


def compose_config(overrides: list[str], plan: Plan) -> Config:
    """train.py's config for ``overrides``, with the step count, logging, evaluation and
    checkpoints set so that only the plan's last step is logged, none evaluates mid-run and
    none saves. Its output_dir is set apart (``in_folder``)."""
    forced = [
        "output_dir=.",
        f"train.max_steps={plan.max_steps}",
        f"train.log_every={plan.max_steps}",
        f"train.eval_every={plan.max_steps}",
        "train.stop_at_step=null",
        "checkpoint.enabled=false",
    ]
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*_defaults(overrides), *forced])
    return to_dataclass(cfg)


# Set first unless the overrides set them (Hydra refuses a group chosen twice): no W&B, and
# no memory probes, which the report does not use. A probe's tracker runs Python at every
# new storage, and on an H200 a tracked llama-1b step outlasted 50 s beside the profile.
DEFAULTS = {"logger": "none", "train.memory_tracking": "off"}


def _defaults(overrides: list[str]) -> list[str]:
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [f"{k}={v}" for k, v in DEFAULTS.items() if k not in given] + overrides


def refuse_multi_rank(cfg: Config) -> None:
    if cfg.launcher.nproc_per_node > 1 or external_rank_env() is not None:
        raise ConfigError(
            "profile_step profiles one process: launcher.nproc_per_node="
            f"{cfg.launcher.nproc_per_node} (or torchrun) starts ranks it does not "
            "instrument; profile a strategy on one rank (launcher.nproc_per_node=1)"
        )


def _scoped(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


class _ScopedLoader:
    """The train loader with each batch drawn inside the ``data`` scope."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        return self

    def __next__(self):
        with record_function("data"):
            return next(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


@dataclass
class Windows:
    """Stands in for llm.run's Trainer: builds the real one, wraps its pieces in scopes and
    opens and closes the profiler and the host-read counter at the plan's steps."""

    plan: Plan
    record_shapes: bool = False
    prof: profile | None = None
    reads: HostReads = field(default_factory=HostReads)
    counting: bool = False
    device: torch.device | None = None
    wall_s: float = 0.0
    step_kinds: dict[int, dict] = field(default_factory=dict)
    _t0: float = 0.0

    def trainer(self, *args, **kwargs) -> Trainer:
        trainer = Trainer(*args, **kwargs)
        self.device = trainer.device
        trainer.train_loader = _ScopedLoader(trainer.train_loader)
        trainer.strategy.backward = _scoped("backward", trainer.strategy.backward)
        trainer.strategy.clip_and_step = _scoped("optimizer", trainer.strategy.clip_and_step)
        trainer._logits = _scoped("forward", trainer._logits)
        # The host-to-device copy of a batch is data loading too.
        trainer._to_device = _scoped("data", trainer._to_device)
        step = trainer.train_step

        def train_step(timer, stop):
            n = trainer.state.step + 1
            self._at(n)
            if n in self.plan.profiled or n in self.plan.counted:
                self.step_kinds[n] = {
                    "probe": trainer.probes.probes(n),
                    "logged": trainer.probes.logs(n),
                }
            with record_function("step"):
                return step(timer, stop)

        trainer.train_step = train_step
        return trainer

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _at(self, step: int) -> None:
        """Open or close a window before ``step`` runs."""
        if step == self.plan.profiled.start:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, record_shapes=self.record_shapes)
            self._sync()
            self.prof.start()
            self._t0 = time.perf_counter()
        elif step == self.plan.counted.start:
            self._sync()
            self.wall_s = time.perf_counter() - self._t0
            self.prof.stop()
            self.reads.__enter__()
            self.counting = True
        elif step == self.plan.max_steps:
            self.close()

    def close(self) -> None:
        """Leave the counter (and a profiler a failed run left running)."""
        if self.counting:
            self.reads.__exit__(None, None, None)
            self.counting = False
        if self.prof is not None and not self.wall_s:
            self.prof.stop()


def _scoped_head_loss(head_loss):
    """llm.train.loss.head_loss with the head it makes (a fused loss, called inside the
    model's forward, the head's matmul with it) in the ``loss`` scope."""

    @functools.wraps(head_loss)
    def make(*args, **kwargs):
        return _scoped("loss", head_loss(*args, **kwargs))

    return make


def run(cfg: Config, windows: Windows, run_dir: Path) -> dict:
    """Train ``cfg`` in this process (llm.launch, as train.py does for one process) with
    ``windows`` standing in for the Trainer and the loss in its scope, plain or fused;
    returns the run's summary."""
    shutil.rmtree(run_dir, ignore_errors=True)  # the tool's own run folder, from a rerun
    trainer_module = llm.train.trainer
    plain, fused = trainer_module._cross_entropy_sum, trainer_module.head_loss
    try:
        with (
            mock.patch.object(llm.run, "Trainer", windows.trainer),
            mock.patch.object(trainer_module, "_cross_entropy_sum", _scoped("loss", plain)),
            mock.patch.object(trainer_module, "head_loss", _scoped_head_loss(fused)),
        ):
            return launch(cfg)
    finally:
        windows.close()


def default_name(cfg: Config) -> str:
    return "-".join(
        [cfg.model.name, cfg.parallelism.name, cfg.precision.name, cfg.attention.backend]
    )


def profile_run(overrides: list[str], plan: Plan, out: Path | None, record_shapes: bool):
    """(the output folder, the instrumented windows, the run's summary) of one profiled
    run; the run's own files go to <out>/run."""
    cfg = compose_config(overrides, plan)
    out = out or REPO / "outputs" / "profile_step" / default_name(cfg)
    cfg = dataclasses.replace(cfg, output_dir=str(out / "run"))
    validate(cfg)
    refuse_multi_rank(cfg)
    windows = Windows(plan, record_shapes)
    return out, windows, run(cfg, windows, out / "run")
