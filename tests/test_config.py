"""Every config option composes and validates; every impossible combination is refused with
one line naming the problem and the fix, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import CONF, compose_config
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from llm.errors import ConfigError
from llm.launch.launcher import external_rank_env, resolve_wandb_mode
from llm.validate import validate

# conf/device/ holds device profiles for estimate.device (llm.estimate.device_profile), no group.
GROUPS = sorted(
    p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("experiment", "device")
)
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
LAYOUTS = sorted(p.stem for p in (CONF / "layout").glob("*.yaml"))
BASE = ["output_dir=/tmp/unused"]
# Attention backends that cannot train on CPU, and what their refusal says there.
GPU_ATTENTION = {
    "flash_attn": "flash-attn package",
    "flex": "no backward",
    "triton": "triton",
    "xformers": "xformers package",
}


def test_every_group_has_options():
    assert set(GROUPS) >= {
        "model",
        "parallelism",
        "precision",
        "optimizer",
        "scheduler",
        "data",
        "recompute",
        "attention",
        "logger",
        "monitor",
        "launcher",
    }


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
@pytest.mark.slow
def test_every_option_composes(group, option, tmp_path):
    extra = [f"{group}={option}"]
    if group == "data" and option == "files":
        extra.append(f"data.path={tmp_path}")
    if group == "model":
        extra.append("data.seq_len=64")
    if group == "recompute" and option == "budget":
        extra.append("train.compile=true")  # the compiler's partitioner
    cfg = compose_config(BASE + extra)
    # The group's own option name is carried into the typed config.
    if group == "model":
        assert cfg.model.name == option
    if group == "parallelism" and option.startswith("deepspeed") and option[-1].isdigit():
        # deepspeed1-3: DeepSpeed's engine at one stage, one option per stage for sweeps.
        assert (cfg.parallelism.name, cfg.parallelism.zero_stage) == ("deepspeed", int(option[-1]))
    elif group == "precision" and option.startswith("fp8_"):
        # fp8_<recipe>: precision=fp8 with that recipe, one choice for sweeps.
        assert (cfg.precision.name, cfg.precision.fp8_recipe) == (
            "fp8",
            option.removeprefix("fp8_"),
        )
    elif group in ("precision", "optimizer", "scheduler", "data", "recompute", "parallelism"):
        assert getattr(cfg, group).name == option
    if group == "precision" and option == "tf32" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
            validate(cfg)
    elif group == "recompute" and option == "offload" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="recompute=offload moves activations from the GPU"):
            validate(cfg)
    elif group == "attention" and option in GPU_ATTENTION and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=GPU_ATTENTION[option]):
            validate(cfg)
    else:
        validate(cfg)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    validate(compose_config([*BASE, f"experiment={experiment}"]))


def _swept_layouts(experiment: str) -> list[str]:
    sweep = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
    return sweep.hydra.sweeper.params["layout"].split(",")


LAYOUT_SWEEPS = ("parallel_layouts", "parallel_strategies")
SWEPT_LAYOUTS = [(e, layout) for e in LAYOUT_SWEEPS for layout in _swept_layouts(e)]


# Expert-parallel layouts set model=moe-tiny; tests/test_expert_parallel_training.py runs
# each against one process.
EP_LAYOUTS = [layout for layout in LAYOUTS if "_ep" in layout]


def test_layout_sweeps_use_every_layout():
    """parallel_layouts sweeps every dense layout gpt2-tiny's 2 blocks allow;
    parallel_strategies adds pp4 (4 blocks)."""
    assert EP_LAYOUTS
    assert sorted({layout for _, layout in SWEPT_LAYOUTS}) == sorted(set(LAYOUTS) - set(EP_LAYOUTS))
    assert set(LAYOUTS) - set(EP_LAYOUTS) - set(_swept_layouts("parallel_layouts")) == {"pp4"}


@pytest.mark.parametrize(("experiment", "layout"), SWEPT_LAYOUTS)
def test_every_layout_of_four_ranks_is_accepted(experiment, layout):
    """Each job of `python train.py -m experiment=parallel_layouts` (or parallel_strategies),
    checked as train.py checks it before ranks start; dp x tp x pp covers the 4 ranks."""
    cfg = compose_config([*BASE, f"experiment={experiment}", f"layout={layout}"])
    validate(cfg)
    p = cfg.parallelism
    assert p.dp_size * p.tp_size * p.pp_size == cfg.launcher.nproc_per_node == 4
    first = layout.split("_")[0]
    assert p.name == ("single" if first in ("tp4", "tp2", "pp4") else first)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_steps=0"], "train.max_steps=0 must be > 0"),
        (["train.micro_batch_size=-2"], "train.micro_batch_size=-2 must be > 0"),
        (["data.seq_len=0"], "data.seq_len=0 must be > 0"),
        (["model.d_model=-1"], "model.d_model=-1 must be > 0"),
        (["model=gpt2-tiny", "data.seq_len=4096"], "exceeds model gpt2-tiny's max_seq_len=256"),
        (["attention.backend=nope"], "attention.backend='nope' is unknown"),
        (["parallelism.name=nope"], "parallelism.name='nope' is unknown"),
        (["launcher.nproc_per_node=2"], "parallelism=single runs one process"),
        (["checkpoint.resume=/does/not/exist"], "checkpoint.resume=/does/not/exist does not exist"),
        (["model.init_from=/does/not/exist"], "model.init_from=/does/not/exist is not a directory"),
        (["data=files"], "data=files needs data.path"),
        (["model.name=gpt5"], "gpt5"),
        (
            ["parallelism.pp_size=2", "parallelism.pp_virtual_stages=2"],
            "pp_schedule=1f1b runs one stage per rank",
        ),
        (["recompute=budget"], "recompute=budget is torch.compile's partitioner and needs"),
        (["recompute=offload"], "recompute=offload moves activations from the GPU"),
        (["recompute=full", "recompute.every=0"], "recompute.every=0 must be > 0"),
        (["recompute=budget", "recompute.memory_budget=2"], "recompute.memory_budget=2.0 must"),
        (["recompute=selective", "recompute.save_every_other_mm=true"], "op_sac only"),
    ],
)
def test_impossible_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        validate(compose_config(BASE + overrides))
    assert "\n" not in str(err.value)  # one line


def test_a_short_run_with_the_default_warmup_is_accepted():
    # The default warmup (30 steps) is clamped to the run rather than refused.
    validate(compose_config([*BASE, "train.max_steps=6"]))


def test_unknown_option_is_a_hydra_error():
    with pytest.raises(MissingConfigException, match="model"):
        compose_config([*BASE, "model=gpt5"])


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cfg = compose_config(
        [*BASE, "parallelism=ddp", "launcher.nproc_per_node=4", "train.device=cuda"]
    )
    with pytest.raises(ConfigError, match="only 2 GPU"):
        validate(cfg)


def test_cuda_without_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="no CUDA device"):
        validate(compose_config([*BASE, "train.device=cuda"]))


def test_launcher_env_detection():
    assert external_rank_env({}) is None
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
    }
    env = external_rank_env(torchrun)
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (
        3,
        1,
        8,
        "n1",
        1234,
    )


# What a process sees inside a 4-task allocation (salloc -n 4, or sbatch -n 4).
ALLOCATION = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_NNODES": "1"}


def test_srun_tasks_are_ranks():
    srun = {
        **ALLOCATION,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "2",
        "MASTER_ADDR": "h0",
    }
    env = external_rank_env(srun)
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (
        2,
        2,
        4,
        "h0",
        20077,
    )
    # A step of 2 tasks in the 4-task allocation (srun -n 2) is a world of 2.
    assert external_rank_env({**srun, "SLURM_STEP_NUM_TASKS": "2"}).world_size == 2
    # Older Slurm sets only SLURM_STEPID.
    old = {k: v for k, v in srun.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert external_rank_env(old).world_size == 4


@pytest.mark.parametrize(
    "env",
    [
        # salloc's shell: the allocation's variables, no job step.
        ALLOCATION,
        # an sbatch script (the batch step): SLURM_PROCID=0 too, still no srun step.
        {**ALLOCATION, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
        # salloc's interactive step (LaunchParameters=use_interactive_step): a special id.
        {**ALLOCATION, "SLURM_STEP_ID": str(0xFFFFFFFA), "SLURM_PROCID": "0"},
        # one srun task (e.g. submitit with tasks_per_node=1): not a distributed launch.
        {**ALLOCATION, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"},
    ],
    ids=["salloc-shell", "sbatch-script", "interactive-step", "one-srun-task"],
)
def test_a_plain_process_in_an_allocation_is_not_a_rank(env):
    # It spawns launcher.nproc_per_node local ranks itself instead of waiting for 3 peers.
    assert external_rank_env(env) is None


def test_wandb_mode_is_offline_without_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("disabled") == "disabled"


def test_config_files_exist_for_design_keys():
    cfg = compose_config(BASE)
    for key in (
        "max_steps",
        "micro_batch_size",
        "grad_accum_steps",
        "seed",
        "log_every",
        "eval_every",
    ):
        assert hasattr(cfg.train, key)
    assert cfg.data.seq_len > 0 and cfg.checkpoint.resume == "auto"
    assert cfg.launcher.nproc_per_node == 1
    assert Path(CONF / "config.yaml").is_file()


def test_slurm_launcher_composes():
    """`hydra/launcher=submitit_slurm` is installed and composes with our config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[*BASE, "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=8"],
            return_hydra_config=True,
        )
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == 8
