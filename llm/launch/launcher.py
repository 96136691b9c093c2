"""Starting ranks. The one module that reads the environment (docs/design.md): it finds out whether
torchrun, Slurm or the deepspeed launcher already started this process as one rank, and
otherwise spawns ``launcher.nproc_per_node`` local ranks itself.
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from traceback import format_exc

import torch.multiprocessing as mp

from llm.config import Config
from llm.errors import Interrupted, LabError, TrainingError
from llm.launch.agent_watch import watch_agent
from llm.launch.rank_failures import rank_failure, record_rank_failure
from llm.launch.slurm_requeue import ignore_in_rank, requeue_on_preemption
from llm.logging import run_log
from llm.parallel.dist import RankEnv
from llm.parallel.hangs import trace_prefix
from llm.runfiles.run_dir_lock import RunDirLock
from llm.runfiles.run_record import write_run_record
from llm.train.checkpoint import describe
from llm.train.checkpoint_files import list_checkpoints
from llm.train.stop import announce_stop, exit_code, stop_guard

REPO = Path(__file__).resolve().parents[2]
ERRORS_DIR = ".rank_errors"


def external_rank_env(env: dict[str, str] | None = None) -> RankEnv | None:
    """This process's rank when an outside launcher started it, else None."""
    env = os.environ if env is None else env
    # torchrun and the deepspeed launcher both export the torch.distributed variables.
    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
        here = env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE"))
        return RankEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            init_method="env://",
            local_world_size=int(here) if here and here.isdigit() else None,
            binding_vars=binding_vars(env),
        )
    if _srun_step_tasks(env) > 1:
        return RankEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=_srun_step_tasks(env),
            master_addr=env.get("MASTER_ADDR") or _slurm_first_host(env),
            # Every task must agree on the port without talking: derive it from the job id.
            master_port=int(
                env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
            ),
            local_world_size=_slurm_tasks_on_node(env),
            binding_vars=binding_vars(env),
        )
    return None


_BINDING_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_LOCALID", "LOCAL_RANK")


def binding_vars(env) -> tuple[tuple[str, str], ...]:
    """The variables that decide a rank's GPU (llm.parallel.binding), for its refusal."""
    return tuple((name, env[name]) for name in _BINDING_VARS if name in env)


def _slurm_tasks_on_node(env) -> int | None:
    """This node's tasks in the job step: SLURM_STEP_TASKS_PER_NODE ("8(x2),4": 8 on each of
    the first two nodes, 4 on the third) at SLURM_NODEID; None when Slurm does not say."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or not (repeat.rstrip(")") or "1").isdigit():
            return None
        counts += [int(count)] * int(repeat.rstrip(")") or "1")
    node = env.get("SLURM_NODEID", "0")
    if not node.isdigit() or int(node) >= len(counts):
        return None
    return counts[int(node)]


# Slurm numbers the steps srun starts from 0; its special steps (the batch script's, the
# extern step, salloc's interactive step) take the ids from 0xFFFFFFFA up.
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFFA


def _srun_step_tasks(env) -> int:
    """How many tasks srun started in the job step this process is one of; 0 when srun did
    not start it. Only srun's tasks are ranks: a shell inside ``salloc`` and an ``sbatch``
    script also see the allocation's SLURM_NTASKS (and SLURM_PROCID=0), but a plain
    ``python train.py`` there is one process, not rank 0 of n. srun sets SLURM_STEP_ID (and
    the older SLURM_STEPID) for its tasks; the batch script's step gets none."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not step.isdigit() or int(step) >= _FIRST_SPECIAL_STEP_ID or "SLURM_PROCID" not in env:
        return 0
    return int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))


def _slurm_first_host(env) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST", "127.0.0.1")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
        return out.stdout.split()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return nodelist


def resolve_wandb_mode(mode: str) -> str:
    """'auto' becomes online only when W&B credentials exist, so a fresh machine never
    blocks on a login prompt; WANDB_MODE, when set, wins as wandb itself would have it."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        hosts = {}
    return "online" if "api.wandb.ai" in hosts else "offline"


def set_cache_dirs(root: Path = REPO / ".cache") -> None:
    """JIT builds and compile caches go to known folders (kept between runs, never in ~)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))


def enable_flight_recorder(run_dir: Path) -> str:
    """Turn on NCCL's flight recorder for the ranks this process is or starts, unless the
    user set its variables: each rank keeps its last 2000 collectives and dumps them when
    one times out, to ``run_dir``/nccl_trace_rank_N (llm/parallel/hangs.py). Set before any
    process group exists (torch reads them when it makes one); a value this process set for
    an earlier job (a sweep, tests) is replaced. Returns the dumps' prefix in effect."""
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(trace_prefix(run_dir)),
    }
    for name, value in wanted.items():
        if os.environ.get(name, _FLIGHT_RECORDER_SET.get(name)) == _FLIGHT_RECORDER_SET.get(name):
            os.environ[name] = _FLIGHT_RECORDER_SET[name] = value
    return os.environ["TORCH_FR_DUMP_TEMP_FILE"]


_FLIGHT_RECORDER_SET: dict[str, str] = {}  # what enable_flight_recorder set, by name


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop ``--local_rank=N`` / ``--local_rank N`` that the deepspeed launcher appends; the
    same rank arrives in the LOCAL_RANK variable, which external_rank_env reads."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--local_rank":
            skip = True
        elif not arg.startswith("--local_rank="):
            out.append(arg)
    return out


def export_local_rank(env: RankEnv) -> RankEnv:
    """Set LOCAL_RANK as torchrun and the deepspeed launcher do for the ranks we start:
    DeepSpeed refuses to build an engine without it and places work on that device.
    Returns ``env`` with the variables that decide its GPU."""
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    return dataclasses.replace(
        env,
        binding_vars=binding_vars(os.environ),
        trace_prefix=os.environ.get("TORCH_FR_DUMP_TEMP_FILE"),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_for_ranks(cfg: Config) -> Config:
    """Resolve everything that must be the same on every rank before they start."""
    logger = dataclasses.replace(cfg.logger, mode=resolve_wandb_mode(cfg.logger.mode))
    data = dataclasses.replace(cfg.data, cache_dir=str(Path(cfg.data.cache_dir).resolve()))
    return dataclasses.replace(
        cfg, logger=logger, data=data, output_dir=str(Path(cfg.output_dir).resolve())
    )


@requeue_on_preemption(os.environ)  # under submitit on Slurm: a stopped run is requeued
def launch(cfg: Config, record: dict[str, str] | None = None) -> dict:
    """Run training: in this process when a launcher made it a rank (or for one rank),
    else by spawning local ranks. ``record``: the run's .hydra files (train.py's), written
    once the run directory's lock is held. Returns the run summary; raises Interrupted when
    a signal stopped the run (at any moment: start-up, training, the final save or after
    it), once the ranks have checkpointed."""
    with stop_guard() as stop:
        summary = _launch(cfg, record)
        signal_name = summary.get("stop_signal") or stop.signal
    if signal_name is not None:
        raise Interrupted(stopped_message(cfg, signal_name), exit_code(signal_name))
    return summary


def _launch(cfg: Config, record: dict[str, str] | None) -> dict:
    from llm import run
    from llm.data import prepare_data

    set_cache_dirs()
    cfg = prepare_for_ranks(cfg)
    env = external_rank_env()
    if env is not None:
        env = dataclasses.replace(env, trace_prefix=enable_flight_recorder(Path(cfg.output_dir)))
        with watch_agent(env):  # under torchrun: a lost agent or node, named in one line
            return run.main(cfg, env, lock_run_dir=True, record=record)
    # Taken before any work and any write, held until the ranks are done; the kernel frees
    # it if this process dies.
    with RunDirLock(Path(cfg.output_dir)):
        write_run_record(Path(cfg.output_dir), record)
        # Tokenizer training and tokenising happen once here, not once per rank.
        prepare_data(cfg.data)
        enable_flight_recorder(Path(cfg.output_dir))  # spawned ranks inherit it
        n = cfg.launcher.nproc_per_node
        if n == 1:
            env = RankEnv(0, 0, 1, cfg.launcher.master_addr, free_port(), local_world_size=1)
            return run.main(cfg, export_local_rank(env))
        return _spawn(cfg, n)


def _spawn(cfg: Config, n: int, rank_main: Callable[[Config, RankEnv], dict] | None = None) -> dict:
    """Run ``rank_main`` (llm.run.main; tests pass a stand-in, importable by name) on ``n``
    spawned ranks and return rank 0's summary. Forwards SIGTERM and SIGINT to the ranks as
    SIGTERM and waits for them; a failed rank is reported by its own line. Any other
    exception while waiting kills the ranks before it propagates."""
    # A fresh port per job: under -m, consecutive jobs in one process must not collide.
    port = cfg.launcher.master_port or free_port()
    errors = Path(cfg.output_dir) / ERRORS_DIR
    shutil.rmtree(errors, ignore_errors=True)  # left by an earlier failed run in this dir
    contexts, received = [], []

    def stop_ranks(signum, frame) -> None:
        # Slurm signals the launcher (SIGTERM), Ctrl-C the whole process group (SIGINT):
        # ranks hear SIGTERM either way, checkpoint and stop; we wait for them. A second
        # Ctrl-C stops them at once (their checkpoints are atomic: the newest whole one stays).
        again = signum == signal.SIGINT and signal.SIGINT in received
        if not received:  # the launcher owns the terminal: it says what happens next
            announce_stop(signal.Signals(signum).name)
        received.append(signum)
        for context in contexts:
            _forward(context, signal.SIGKILL if again else signal.SIGTERM)

    # Installed first: a Ctrl-C while ranks start must not end the launcher alone.
    previous = {sig: signal.signal(sig, stop_ranks) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        context = mp.start_processes(
            _rank_entry,
            args=(cfg, n, cfg.launcher.master_addr, port, rank_main),
            nprocs=n,
            join=False,
            start_method="spawn",
        )
        contexts.append(context)
        if received:  # it came while the ranks were being started: pass it on now
            _forward(context, signal.SIGTERM)
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:
        if not received:
            raise TrainingError(
                rank_failure(
                    errors,
                    exc.error_index,
                    exc.exit_code,
                    exc.signal_name,
                    os.environ.get("TORCH_FR_DUMP_TEMP_FILE"),
                )
            ) from None
        name = signal.Signals(received[0]).name
        message = stopped_message(cfg, name)
        # A rank that ended by the signal we passed on (it was still starting, or a second
        # Ctrl-C) stopped as asked; anything else is a failure while stopping, named.
        if exc.signal_name not in ("SIGTERM", "SIGKILL") or any(errors.glob("rank*.txt")):
            failure = rank_failure(errors, exc.error_index, exc.exit_code, exc.signal_name)
            message = f"{message}; while stopping, {failure}"
        raise Interrupted(message, exit_code(name)) from None
    except BaseException:
        # Anything else that ends the wait (the caller's timeout, an error here) would leave
        # the ranks training on their own, holding their memory: end them first.
        for context in contexts:
            _forward(context, signal.SIGKILL)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:  # the ranks checkpointed and stopped as asked
        name = signal.Signals(received[0]).name
        raise Interrupted(stopped_message(cfg, name), exit_code(name))
    return _read_summary(cfg)


def _forward(context, sig) -> None:
    for process in context.processes:
        if process.is_alive():
            os.kill(process.pid, sig)


def stopped_message(cfg: Config, signal_name: str) -> str:
    """The one line for a run a signal stopped: which signal, and the checkpoint to resume
    from (the newest one, which the run wrote on the way out)."""
    what = "interrupted (Ctrl-C)" if signal_name == "SIGINT" else f"terminated ({signal_name})"
    found = list_checkpoints(Path(cfg.output_dir) / "checkpoints")
    if not found:
        return f"{what} before any checkpoint was written; nothing to resume"
    return f"{what}; the newest checkpoint is {found[-1]}: run the same command to resume from it"


def _read_summary(cfg: Config) -> dict:
    return json.loads((Path(cfg.output_dir) / "summary.json").read_text())


def _rank_entry(
    local_rank: int, cfg: Config, world_size: int, addr: str, port: int, rank_main=None
) -> None:
    if rank_main is None:
        from llm import run

        rank_main = run.main
    env = RankEnv(local_rank, local_rank, world_size, addr, port, local_world_size=world_size)
    env = export_local_rank(env)
    ignore_in_rank(os.environ)  # submitit's preemption signal: the launcher passes it on
    try:
        # This rank's lines reach the run's train.log; a SIGTERM from here on is a stop.
        with run_log(Path(cfg.output_dir), f"rank {local_rank}"), stop_guard():
            rank_main(cfg, env)
    except (SystemExit, KeyboardInterrupt):
        raise
    except LabError as exc:
        # Our errors are one line for the user; the parent re-raises the first one.
        record_rank_failure(Path(cfg.output_dir) / ERRORS_DIR, local_rank, str(exc))
        raise SystemExit(2) from None
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        text = f"rank {local_rank} failed: {describe(exc)}"
        record_rank_failure(Path(cfg.output_dir) / ERRORS_DIR, local_rank, text, format_exc())
        raise SystemExit(1) from None
