"""``python -m llm.estimate [overrides]``: the memory a run would need, per rank, without
building it (the model on the meta device), with the same Hydra overrides as train.py plus
``estimate.*`` (llm.config.EstimateConfig); ``estimate.plan=true`` lists what fits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from llm.config import register_configs, to_dataclass
from llm.errors import LabError
from llm.estimate.estimator import estimate
from llm.estimate.plan import plan
from llm.estimate.report import human, print_estimate
from llm.validate import model_args_for

register_configs()
CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _title(cfg) -> str:
    return (
        f"{cfg.model.name} {cfg.parallelism.name} x{cfg.estimate.num_devices or cfg.launcher.nproc_per_node} "
        f"{cfg.precision.name} recompute={cfg.recompute.name} micro_batch={cfg.train.micro_batch_size} "
        f"seq_len={cfg.data.seq_len} attention={cfg.attention.backend} ({cfg.estimate.device})"
    )


def _plan_table(options) -> Table:
    table = Table(title="runs that fit, best first (estimated time per token)")
    for name in (
        "strategy",
        "precision",
        "recompute",
        "micro-batch",
        "per rank",
        "recompute FLOPs",
        "comm/step",
        "us/token",
    ):
        table.add_column(name)
    for o in options:
        table.add_row(
            o.strategy,
            o.precision,
            o.recompute,
            str(o.micro_batch),
            human(o.estimate.total),
            f"+{o.recompute_fraction:.1%}",
            human(o.estimate.comm_bytes),
            f"{o.seconds_per_token * 1e6:.3f}",
        )
    return table


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_dataclass(dict_cfg)
        args = model_args_for(cfg, vocab_size=cfg.data.vocab_size)
        est = estimate(cfg, args)
        print_estimate(est, _title(cfg))
        out = est.to_json()
        if cfg.estimate.plan:
            options = plan(cfg, args)
            Console().print(_plan_table(options))
            out["plan"] = [
                {
                    "strategy": o.strategy,
                    "precision": o.precision,
                    "recompute": o.recompute,
                    "micro_batch": o.micro_batch,
                    "total_bytes": o.estimate.total,
                    "recompute_fraction": o.recompute_fraction,
                    "comm_bytes_per_step": o.estimate.comm_bytes,
                    "seconds_per_token": o.seconds_per_token,
                }
                for o in options
            ]
        if cfg.estimate.json:
            Path(cfg.estimate.json).write_text(json.dumps(out, indent=2))
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
