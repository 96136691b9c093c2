"""``launcher.*``: local ranks, their backend and rendezvous (conf/launcher/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive


@dataclass
class LauncherConfig:
    name: str = "local"
    nproc_per_node: int = 1
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port is picked per job (safe for -m sweeps)
    # CPU ranks beyond the cores this process may use are warned about, and beyond 4 per
    # core refused (each rank holds a whole model and they fight for the cores), unless
    # this says it is meant (llm/validate/checks.py).
    allow_oversubscribe: bool = False
    # How long a rank waits for a peer that shows no sign of life: the process group's
    # timeout (a collective that waits longer ends the run, and NCCL's watchdog dumps every
    # rank's last collectives first: llm/parallel/hangs.py), and the data preparation's wait
    # (llm/data/per_node.py), which gives up when a rank stops answering for this long,
    # however long the preparation itself takes.
    timeout_min: float = 10.0

    def __post_init__(self) -> None:
        require_positive(
            "launcher", nproc_per_node=self.nproc_per_node, timeout_min=self.timeout_min
        )
        require_choice("launcher", "backend", self.backend, ("auto", "gloo", "nccl"))
