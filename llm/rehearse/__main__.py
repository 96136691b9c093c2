"""``python -m llm.rehearse rehearse.world_size=N [rehearse.rank=R] [overrides]``: rank R of
an N-rank run, run for real in this one process over torch's fake process group
(llm.rehearse.rank), with the same Hydra overrides as train.py. Prints the rank's peak by
category, its compute time per step and the bytes of each collective, and writes them to
``rehearse.json`` (default: the run directory's rehearse.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from llm.config import register_configs, to_dataclass
from llm.errors import LabError
from llm.rehearse.rank import rehearse
from llm.rehearse.report import print_rehearsal, rehearsal_figures

register_configs()
CONF = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_dataclass(dict_cfg)
        summary = rehearse(cfg)
        r = cfg.rehearse
        figures = rehearsal_figures(summary, r.world_size, r.rank)
        print_rehearsal(figures)
        path = Path(r.json) if r.json else Path(cfg.output_dir) / "rehearse.json"
        path.write_text(json.dumps(figures, indent=2))
        print(f"written: {path}")
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
