"""``python -m llm.generate generate.run_dir=RUN generate.prompt="..." [generate.* ...]``:
sample from a trained run's newest verified checkpoint (or ``generate.checkpoint``: one
checkpoint, or a Hugging Face model folder) and write ``generate.json`` beside the log.

The command's Hydra entry only; the work is llm/inference/cli.py. The entry stays here so
that Hydra names the job (and its log file, generate.log) after this module."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from llm.config import register_configs, to_dataclass
from llm.errors import LabError
from llm.inference.cli import print_result, run

register_configs()
CONF = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_dataclass(dict_cfg)
        output_dir = Path(cfg.output_dir)
        print_result(run(cfg.generate, output_dir), output_dir)
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
