"""ZeRO-Infinity's NVMe tier for our ZeRO: offloaded optimizer states and stage-3 parameter
shards in files under ``parallelism.nvme_path`` (docs/zero.md, "The NVMe tier")."""

from llm.parallel.zero.nvme.folder import RankFolder, check_nvme_path
from llm.parallel.zero.nvme.optimizer_swap import OptimizerSwap
from llm.parallel.zero.nvme.param_swap import ParamSwap

__all__ = ["OptimizerSwap", "ParamSwap", "RankFolder", "check_nvme_path"]
