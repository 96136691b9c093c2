"""One logging interface for a run: metrics.jsonl (always), Weights & Biases (logger=wandb),
and the console (a rich progress bar on a terminal, plain lines otherwise). Rank 0 logs;
other ranks get a logger that does nothing.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llm.config import LoggerConfig


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """One level of keys for W&B: nested dicts join with "/", and lists (in our metrics
    and summary, always one entry per rank) name their items rank0, rank1, ...:
    ``memory_peak/rank0/params``. None is dropped."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, list):
            value = {f"rank{i}": v for i, v in enumerate(value)}
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif value is not None:
            flat[name] = value
    return flat


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
            mode=cfg.mode,  # launch.py resolved "auto" to online/offline
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

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time()}
        record.update({k: _finite_or_none(v) for k, v in metrics.items()})
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(flatten(metrics), step=step)
        if self.progress is None:
            shown = "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in metrics.items()
                if k in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s")
            )
            line = f"step {step:>6}/{self.max_steps}  {shown}"
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def alert(self, message: str) -> None:
        self.console.print(f"[yellow]alert:[/yellow] {message}")
        if self.wandb_run is not None:
            self.wandb_run.alert(title="training alert", text=message)

    def info(self, message: str) -> None:
        self.console.print(message)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            run = self.wandb_run
            summary = {**summary, "wandb": {"id": run.id, "group": run.group, "dir": run.dir}}
        with open(self.output_dir / "summary.json", "w") as f:
            json.dump({k: _finite_or_none(v) for k, v in summary.items()}, f, indent=2)
        if self.wandb_run is not None:
            flat = flatten(summary)
            self.wandb_run.summary.update(
                {k: v for k, v in flat.items() if isinstance(v, int | float | str)}
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.metrics_file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class NullLogger:
    """What ranks other than 0 log with."""

    def advance(self, *args, **kwargs) -> None: ...

    def log(self, *args, **kwargs) -> None: ...

    def alert(self, *args, **kwargs) -> None: ...

    def info(self, *args, **kwargs) -> None: ...

    def summary(self, *args, **kwargs) -> None: ...

    def close(self) -> None: ...
