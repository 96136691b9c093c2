"""Train a language model: `python train.py [group=option ...] [key=value ...]`.

Hydra composes conf/config.yaml with the command line; the result is checked against the
typed schemas in llm/config.py and by llm/validate.py before any rank starts, then
llm/launch.py runs it (spawning local ranks, or as one rank of torchrun / Slurm / deepspeed).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from llm.config import register_configs, to_dataclass
from llm.errors import Interrupted, LabError

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@record  # under torchrun, a rank's traceback reaches torchrun's failure report
def main(dict_cfg: DictConfig) -> float | None:
    from llm.estimate.startup import announce_estimate
    from llm.launch import external_rank_env, launch
    from llm.validate import validate

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        # One W&B group per sweep: the sweep directory names it.
        dict_cfg.sweep_name = hydra_cfg.sweep.dir.replace("/", "_")
    try:
        cfg = to_dataclass(dict_cfg)
        env = external_rank_env()
        validate(cfg, world_size=env.world_size if env else None)
        if env is None or env.rank == 0:
            announce_estimate(cfg, env.world_size if env else cfg.launcher.nproc_per_node)
        summary = launch(cfg)
    except LabError as exc:
        # One line naming the problem and the fix, not a traceback; torchrun's report
        # shows the same line (its error file).
        get_error_handler().record_exception(exc)
        label = "stopped" if isinstance(exc, Interrupted) else "error"
        print(f"{label}: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    # Returned for sweepers (e.g. Optuna) that minimise the objective.
    return summary.get("final_val_loss")


if __name__ == "__main__":
    from llm.launch import strip_launcher_args

    # The deepspeed launcher appends --local_rank=N, which Hydra would reject as an override.
    sys.argv = strip_launcher_args(sys.argv)
    main()
