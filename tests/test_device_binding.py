"""Which GPU each rank takes (llm.parallel.binding), over the environments that Slurm,
torchrun and the deepspeed launcher give their ranks, with the process's GPU count mocked
(torch.cuda.device_count). The variables are the ones each launcher sets:

- Slurm (srun task): SLURM_STEP_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
  SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE; CUDA_VISIBLE_DEVICES as gres sets it:
  the task's own GPU with --gpus-per-task=1 or --gpu-bind=single:1 (the cgroup renumbers it
  0, or it keeps its index without ConstrainDevices), every GPU of the node without binding;
- torchrun: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT; the GPUs are
  whatever CUDA_VISIBLE_DEVICES the user set (or all);
- the deepspeed launcher (deepspeed/launcher/launch.py): RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_SIZE and CUDA_VISIBLE_DEVICES from --include / --num_gpus.

`make test-slurm` runs the Slurm paths on CPU ranks, where no GPU is bound.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config

from llm.errors import ConfigError
from llm.launch.launcher import _slurm_tasks_on_node, external_rank_env
from llm.parallel.binding import rank_device
from llm.validate import validate

NODE_GPUS = "0,1,2,3,4,5,6,7"


def slurm(local: int, node: int, tasks_per_node: int, visible: str | None) -> dict[str, str]:
    """An srun task of a 2-node step, ``tasks_per_node`` tasks on each node."""
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node * tasks_per_node + local),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_TASKS": str(2 * tasks_per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x2)",
        "MASTER_ADDR": "node0",
    }
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def torchrun(local: int, nproc: int, visible: str | None = None) -> dict[str, str]:
    env = {
        "RANK": str(nproc + local),  # the second node
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(2 * nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def deepspeed(local: int, visible: str) -> dict[str, str]:
    n = len(visible.split(","))
    return {
        "RANK": str(local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(n),
        "LOCAL_SIZE": str(n),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "CUDA_VISIBLE_DEVICES": visible,
    }


def device_of(variables: dict[str, str], gpus: int, monkeypatch) -> torch.device:
    """The device a rank started with ``variables`` picks when it sees ``gpus`` GPUs."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = external_rank_env(variables)
    assert env is not None
    return rank_device(env, torch.cuda.device_count())


# (launcher's variables for each local rank, GPUs each process sees, the ranks of a node)
OWN_GPU = [
    # srun --ntasks-per-node=8 --gpus-per-task=1, devices constrained by the cgroup
    pytest.param(lambda r: slurm(r, 1, 8, "0"), 8, id="slurm-gpus-per-task-cgroup"),
    # the same without ConstrainDevices, and --gpus-per-node=8 --gpu-bind=single:1
    pytest.param(lambda r: slurm(r, 1, 8, str(r)), 8, id="slurm-gpu-bind-single"),
    # torchrun --nproc-per-node=1 with one GPU made visible
    pytest.param(lambda r: torchrun(r, 1, "3"), 1, id="torchrun-one-rank-one-gpu"),
    pytest.param(lambda r: deepspeed(r, "5"), 1, id="deepspeed-include-one-gpu"),
]

WHOLE_NODE = [
    # srun --ntasks-per-node=8 --gpus-per-node=8, no binding: every task sees the node
    pytest.param(lambda r: slurm(r, 1, 8, NODE_GPUS), 8, 8, id="slurm-whole-node"),
    pytest.param(lambda r: torchrun(r, 8), 8, 8, id="torchrun-8-of-8"),
    pytest.param(lambda r: torchrun(r, 4, "4,5,6,7"), 4, 4, id="torchrun-visible-4"),
    pytest.param(lambda r: torchrun(r, 2), 2, 8, id="torchrun-2-ranks-8-gpus"),
    pytest.param(lambda r: deepspeed(r, NODE_GPUS), 8, 8, id="deepspeed-num-gpus-8"),
    pytest.param(lambda r: deepspeed(r, "2,3"), 2, 2, id="deepspeed-include-2"),
]

REFUSED = [
    # 8 tasks on a node that gave the step 4 GPUs without binding them
    pytest.param(lambda r: slurm(r, 0, 8, "0,1,2,3"), 8, 4, id="slurm-8-tasks-4-gpus"),
    # --gpus-per-task=2: each task sees its own two, neither one nor the node's
    pytest.param(lambda r: slurm(r, 0, 4, f"{2 * r},{2 * r + 1}"), 4, 2, id="slurm-2-per-task"),
    pytest.param(lambda r: torchrun(r, 8, "0,1,2,3"), 8, 4, id="torchrun-8-ranks-4-gpus"),
]


@pytest.mark.parametrize("variables, ranks", OWN_GPU)
def test_a_rank_that_sees_one_gpu_takes_cuda_0(variables, ranks, monkeypatch):
    assert [device_of(variables(r), 1, monkeypatch) for r in range(ranks)] == [
        torch.device("cuda", 0)
    ] * ranks


@pytest.mark.parametrize("variables, ranks, gpus", WHOLE_NODE)
def test_a_rank_that_sees_the_node_takes_its_local_rank(variables, ranks, gpus, monkeypatch):
    assert [device_of(variables(r), gpus, monkeypatch) for r in range(ranks)] == [
        torch.device("cuda", r) for r in range(ranks)
    ]


@pytest.mark.parametrize("variables, ranks, gpus", REFUSED)
def test_every_rank_of_a_node_refuses_a_binding_that_fits_neither(
    variables, ranks, gpus, monkeypatch
):
    """Every local rank refuses (rank 0 too, which would otherwise wait in NCCL's start-up
    for the peers that failed), in one line naming the variables and the count."""
    for r in range(ranks):
        with pytest.raises(ConfigError) as exc:
            device_of(variables(r), gpus, monkeypatch)
        (line,) = str(exc.value).splitlines()
        visible = variables(r)["CUDA_VISIBLE_DEVICES"]
        assert f"CUDA_VISIBLE_DEVICES={visible}" in line and f"sees {gpus} GPU(s)" in line
        assert f"local rank {r} of {ranks} on this node" in line
        local = "SLURM_LOCALID" if "SLURM_LOCALID" in variables(r) else "LOCAL_RANK"
        assert f"{local}={r}" in line and "--gpus-per-task=1" in line


def test_a_launcher_that_does_not_say_its_ranks_per_node_binds_by_local_rank(monkeypatch):
    """torchrun always exports LOCAL_WORLD_SIZE; without it (an older launcher) a local
    rank inside the visible GPUs takes its own, one beyond them is refused."""
    variables = {k: v for k, v in torchrun(1, 2).items() if k != "LOCAL_WORLD_SIZE"}
    assert device_of(variables, 2, monkeypatch) == torch.device("cuda", 1)
    variables["LOCAL_RANK"] = "2"
    with pytest.raises(ConfigError, match="LOCAL_RANK=2"):
        device_of(variables, 2, monkeypatch)


@pytest.mark.parametrize(
    "spec, node, expected",
    [("8(x2)", "1", 8), ("2,1", "1", 1), ("4(x2),3", "2", 3), ("4", "0", 4), ("4", "1", None)],
)
def test_slurm_tasks_on_this_node(spec, node, expected):
    env = {"SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_NODEID": node}
    assert _slurm_tasks_on_node(env) == expected


def test_validation_refuses_the_binding_before_any_rank_starts(monkeypatch):
    """train.py validates each rank's config before launch: an outside launcher's binding
    that fits neither rule stops there, before NCCL or the data are touched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    cfg = compose_config(
        ["output_dir=unused", "model=gpt2-tiny", "parallelism=ddp", "train.device=cuda"]
    )
    env = external_rank_env(slurm(5, 0, 8, "0,1,2,3"))
    with pytest.raises(ConfigError, match="SLURM_LOCALID=5"):
        validate(cfg, world_size=env.world_size, rank_env=env)
