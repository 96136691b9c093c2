"""``python -m llm.estimate [overrides]``: the memory a run would need, per rank, without
building it (the model on the meta device), with the same Hydra overrides as train.py plus
``estimate.*`` (llm.config.EstimateConfig); ``estimate.plan=true`` ranks the parallel
layouts that fit the cluster (llm.estimate.plan)."""

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
from llm.estimate.estimator import estimate, world_size
from llm.estimate.plan import global_batch, plan, plan_row
from llm.estimate.report import human, print_estimate
from llm.validate import model_args_for, tokenizer_vocab_size

register_configs()
CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _title(cfg) -> str:
    return (
        f"{cfg.model.name} {cfg.parallelism.name} x{world_size(cfg)} "
        f"{cfg.precision.name} recompute={cfg.recompute.name} micro_batch={cfg.train.micro_batch_size} "
        f"seq_len={cfg.data.seq_len} attention={cfg.attention.backend} ({cfg.estimate.device})"
    )


def _plan_table(cfg, rows) -> Table:
    e = cfg.estimate
    table = Table(
        title=f"layouts that fit {e.nodes} x {e.gpus_per_node or cfg.launcher.nproc_per_node} "
        f"GPUs of {e.device_memory_gb:g} GiB, fastest first (global batch "
        f"{global_batch(cfg, world_size(cfg))} x {cfg.data.seq_len} tokens)"
    )
    # b: sequences per micro-batch; m: micro-batches per step.
    for name in ("dp", "tp", "pp", "zero", "recompute", "b", "m", "per GPU", "bubble", "step s"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        lay = r.layout
        table.add_row(
            *map(str, (lay.dp, lay.tp, lay.pp, lay.zero_stage, lay.recompute)),
            str(lay.micro_batch),
            str(lay.microbatches),
            human(r.bytes_per_gpu),
            f"{r.bubble:.1%}",
            f"{r.step_time_s:.2f}",
        )
    return table


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_dataclass(dict_cfg)
        args = model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg))
        est = estimate(cfg, args)
        print_estimate(est, _title(cfg))
        out = est.to_json()
        if cfg.estimate.plan:
            rows = plan(cfg, args)
            fitting = [r for r in rows if r.fits][: cfg.estimate.plan_rows]
            Console().print(_plan_table(cfg, fitting))
            out["plan"] = [plan_row(r) for r in rows]
        if cfg.estimate.json:
            Path(cfg.estimate.json).write_text(json.dumps(out, indent=2))
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
