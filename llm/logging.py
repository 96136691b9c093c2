"""One logging interface for a run: metrics.jsonl (always), Weights & Biases (logger=wandb),
and the console (a rich progress bar on a terminal, plain lines otherwise). Rank 0 logs;
other ranks get a logger that does nothing.

Every line a run shows at the console is a Python ``logging`` record (``say``): a handler
prints it as it was printed before, and while ``run_log`` is open the run directory's
train.log receives it, and every other record of the process, prefixed with its rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llm.config import LoggerConfig
from llm.errors import DiskFullError
from llm.runfiles.disk import no_space_message, says_no_space

ROLLED_BACK_METRICS = "metrics.rolled_back.jsonl"
# The logger of the lines a run shows the person at its console.
CONSOLE = "llm.console"
# Hydra's job log in the run directory (hydra/job_logging: ${hydra.job.name}.log, train.py's).
RUN_LOG = "train.log"


class ConsoleLines(logging.Handler):
    """Prints each record's message as it is, unwrapped and never read as markup (lines
    carry paths): on the rich console the record names (a RunLogger's: above its progress
    bar), else on stderr, or on stdout when the record says so."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            console = getattr(record, "console", None)
            if console is not None:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
                return
            stream = sys.stdout if getattr(record, "stdout", False) else sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _console_logger() -> logging.Logger:
    logger = logging.getLogger(CONSOLE)
    if not any(isinstance(h, ConsoleLines) for h in logger.handlers):
        logger.addHandler(ConsoleLines())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # not also through Hydra's console handler, in its format
    logger.disabled = False  # the run's own lines, even under hydra/job_logging=disabled
    return logger


def say(
    line: str, level: int = logging.INFO, *, stdout: bool = False, console: Console | None = None
) -> None:
    """Show ``line`` at the console (stderr; ``stdout``: stdout; ``console``: that rich
    console) and, while a run log is open, append it to the run's train.log."""
    _console_logger().log(level, line, extra={"stdout": stdout, "console": console})


def _run_log_path(run_dir: Path) -> str:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return os.path.abspath(Path(run_dir) / RUN_LOG)


class RunLogFile(logging.FileHandler):
    """A run directory's train.log, appended to by every process of the run; each line
    names who wrote it: ``[time][rank 1][logger][LEVEL] - message``."""

    def __init__(self, run_dir: Path, who: str) -> None:
        super().__init__(_run_log_path(run_dir), mode="a", encoding="utf-8")
        self.setFormatter(
            logging.Formatter(f"[%(asctime)s][{who}][%(name)s][%(levelname)s] - %(message)s")
        )

    def move_to(self, run_dir: Path) -> None:
        """Append to ``run_dir``'s train.log from now on."""
        path = _run_log_path(run_dir)
        if path == self.baseFilename:
            return
        self.baseFilename = path
        self.setStream(open(path, "a", encoding=self.encoding)).close()  # noqa: SIM115


_OPEN_RUN_LOGS: list[RunLogFile] = []


@contextmanager
def run_log(run_dir: Path, who: str) -> Iterator[None]:
    """While open, this process's console lines and its records at INFO and above are
    appended to ``run_dir``/train.log, prefixed with ``who`` ("rank 1", "launcher").
    Hydra's own handler of that file (it writes without the prefix) steps aside meanwhile.
    In a process whose logging nobody configured (a spawned rank), warnings still reach
    stderr as logging's last resort printed them there."""
    root = logging.getLogger()
    file = RunLogFile(run_dir, who)
    hydras = [
        h
        for h in root.handlers
        if isinstance(h, logging.FileHandler) and h.baseFilename == file.baseFilename
    ]
    added = [file] if root.handlers else [file, ConsoleLines(logging.WARNING)]
    level = root.level
    for handler in hydras:
        root.removeHandler(handler)
    for handler in added:
        root.addHandler(handler)
    if level > logging.INFO:
        root.setLevel(logging.INFO)
    lines = _console_logger()
    lines.addHandler(file)
    _OPEN_RUN_LOGS.append(file)
    try:
        yield
    finally:
        _OPEN_RUN_LOGS.remove(file)
        lines.removeHandler(file)
        for handler in added:
            root.removeHandler(handler)
        for handler in hydras:
            root.addHandler(handler)
        root.setLevel(level)
        file.close()


def run_log_moves_to(run_dir: Path) -> None:
    """The open run log appends to ``run_dir``'s train.log from now on (rank 0's run
    directory, when this rank's own Hydra run directory is another); no-op when none is
    open."""
    if _OPEN_RUN_LOGS:
        _OPEN_RUN_LOGS[-1].move_to(run_dir)


PER_LAYER = "_per_layer"  # a list under a key ending so has one item per block, not per rank


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """One level of keys for W&B: nested dicts join with "/", and lists (in our metrics
    and summary one entry per rank) name their items rank0, rank1, ...:
    ``memory_peak/rank0/params``; lists under a key ending in ``_per_layer`` name them
    layer0, layer1, ...: ``activation_bytes_per_layer/layer0``. None is dropped."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, list):
            item = "layer" if key.endswith(PER_LAYER) else "rank"
            value = {f"{item}{i}": v for i, v in enumerate(value)}
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif value is not None:
            flat[name] = value
    return flat


def _step_of_row(line: str) -> float:
    """A metrics.jsonl row's step; a torn row (a kill mid-write) counts as after any step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _finite_or_none(value: Any) -> Any:
    # JSON has no NaN/inf; a NaN loss is logged as null (the monitor reports it).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLogger:
    def __init__(
        self,
        cfg: LoggerConfig,
        output_dir: Path,
        run_config: dict,
        max_steps: int,
        run_name: str,
        group: str | None,
        console: Console | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.output_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self._disk_full = False
        self.console = console or Console(stderr=True)
        self.max_steps = max_steps
        self.wandb_run = self._init_wandb(cfg, run_config, run_name, group)
        self.progress = self._init_progress(cfg)

    def _init_wandb(self, cfg: LoggerConfig, run_config: dict, run_name: str, group: str | None):
        if cfg.name != "wandb" or cfg.mode == "disabled":
            return None
        import wandb

        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=group,
            name=run_name,
            tags=list(cfg.tags),
            config=run_config,
            dir=str(self.output_dir),
            mode=cfg.mode,  # llm/launch/launcher.py resolved "auto" to online/offline
            settings=wandb.Settings(console="off", silent=True),
        )

    def _init_progress(self, cfg: LoggerConfig) -> Progress | None:
        if not (cfg.progress and self.console.is_terminal):
            return None
        progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=self.console,
        )
        progress.start()
        self._task = progress.add_task("train", total=self.max_steps, loss="-", tps="-")
        return progress

    def advance(self, step: int, loss: float | None = None, tokens_per_sec: float | None = None):
        """Per-step progress; cheap, so the Trainer calls it every step."""
        if self.progress is None:
            return
        fields = {}
        if loss is not None:
            fields["loss"] = f"{loss:.4f}"
        if tokens_per_sec is not None:
            fields["tps"] = f"{tokens_per_sec:,.0f}"
        self.progress.update(self._task, completed=step, **fields)

    def start_at(self, step: int) -> None:
        """This invocation continues from ``step`` (0: a fresh start). Rows of later steps,
        left by an invocation that got further (it crashed after its last checkpoint, or
        this one resumes from an older checkpoint), move to metrics.rolled_back.jsonl, and
        an earlier invocation's summary.json to summary.previous.json: every consumer then
        sees each step once, and no summary that is not this invocation's."""
        path = self.output_dir / "metrics.jsonl"
        self.metrics_file.close()
        kept, rolled = [], []
        for line in path.read_text().splitlines(keepends=True):
            (kept if _step_of_row(line) <= step else rolled).append(line)
        if rolled:
            with open(self.output_dir / ROLLED_BACK_METRICS, "a") as side:
                side.writelines(rolled)
            tmp = path.with_name(f"{path.name}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self.metrics_file = open(path, "a")  # noqa: SIM115
        summary = self.output_dir / "summary.json"
        if summary.exists():
            os.replace(summary, self.output_dir / "summary.previous.json")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time()}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        with self._disk_full_named("metrics.jsonl"):
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(flatten(metrics), step=step)
        if self.progress is None:
            shown = "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in metrics.items()
                if k in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s")
                and v is not None  # a probe step's line has no timing of its own
            )
            say(f"step {step:>6}/{self.max_steps}  {shown}", console=self.console)

    def alert(self, message: str) -> None:
        say(f"alert: {message}", logging.WARNING, console=self.console)
        if self.wandb_run is not None:
            self.wandb_run.alert(title="training alert", text=message)

    def info(self, message: str) -> None:
        say(message, console=self.console)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            run = self.wandb_run
            summary = {**summary, "wandb": {"id": run.id, "group": run.group, "dir": run.dir}}
        with (
            self._disk_full_named("summary.json"),
            open(self.output_dir / "summary.json", "w") as f,
        ):
            json.dump({k: _finite_or_none(v) for k, v in summary.items()}, f, indent=2)
        if self.wandb_run is not None:
            flat = flatten(summary)
            self.wandb_run.summary.update(
                {k: v for k, v in flat.items() if isinstance(v, int | float | str)}
            )

    @contextmanager
    def _disk_full_named(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if not says_no_space(exc):
                raise
            self._disk_full = True
            raise DiskFullError(no_space_message(self.output_dir, what)) from None

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        try:
            self.metrics_file.close()
        except OSError:
            # Closing flushes what a full disk already refused; that error was reported.
            if not self._disk_full:
                raise
        if self.wandb_run is not None:
            self.wandb_run.finish()


class NullLogger:
    """What ranks other than 0 log with."""

    def start_at(self, step: int) -> None: ...

    def advance(self, *args, **kwargs) -> None: ...

    def log(self, *args, **kwargs) -> None: ...

    def alert(self, *args, **kwargs) -> None: ...

    def info(self, *args, **kwargs) -> None: ...

    def summary(self, *args, **kwargs) -> None: ...

    def close(self) -> None: ...
