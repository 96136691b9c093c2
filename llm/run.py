"""One rank's run: dist init -> model (meta) -> pipeline split -> tensor parallel -> recompute
-> precision -> strategy.wrap (shards, then materialises this rank's part) -> compile
-> optimizer -> data -> Trainer.fit -> summary.json."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llm.attention import resolve_for
from llm.build import model_args_for, resolve_device
from llm.config import Config, TrainConfig
from llm.data import PreparedData, build_train_loader, build_val_loader, save_tokenizer
from llm.data.per_node import prepare_across_ranks
from llm.data.prefetch import Prefetcher
from llm.errors import ConfigError, TrainingError
from llm.logging import NullLogger, RunLogger, run_log_moves_to
from llm.memory import PeakTracker
from llm.models import (
    HFSource,
    InitSource,
    Transformer,
    WeightSource,
    build_model,
    causal_flops_per_token,
    flops_per_token,
    freeze,
    num_active_params,
    num_params,
)
from llm.optim import build_scheduler
from llm.parallel import ParallelDims, build_strategy
from llm.parallel.binding import rank_device
from llm.parallel.dist import RankEnv, gather_object, init_distributed, rehearsing
from llm.parallel.experts.install import expert_mesh
from llm.parallel.experts.install import install as install_experts
from llm.parallel.hangs import collective_timeout, trace_prefix
from llm.parallel.pipeline import PipelineLayout, PipelinePart
from llm.parallel.tensor_parallel import apply_tensor_parallel
from llm.precision import apply_precision, build_loss_scaler, precision_for
from llm.recompute import apply_recompute, recompute_policy
from llm.runfiles.run_dir_lock import RunDirLock
from llm.runfiles.run_record import write_run_record
from llm.train.checkpoint import Checkpointer
from llm.train.metrics import peak_flops
from llm.train.stop import StopRequested, stop_guard
from llm.train.trainer import Trainer

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
# Keys that name where or how a run is logged, not what it computes.
_DIGEST_EXCLUDES = (
    "output_dir",
    "sweep_name",
    "logger",
    "checkpoint",
    "launcher",
    "generate",
    "rehearse",
)


def config_digest(cfg: Config) -> str:
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _DIGEST_EXCLUDES}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shape_digest(args) -> str:
    """What a checkpoint must match to load: the shape, not dropout or the init scale."""
    shape = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("dropout", "init_std")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: torch.device) -> dict:
    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def build_model_for(
    cfg: Config,
    vocab_size: int,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, WeightSource]:
    """The model on the meta device and where its initial weights come from: a Hugging Face
    directory (read slice by slice) or our seeded init. Under tensor parallel our init pads
    the vocabulary to a multiple of tp_size. Its attention is the configured backend, or
    attention=auto's pick for ``device`` and ``dtype`` (what attention computes in)."""
    if cfg.model.init_from is not None:
        weights = HFSource(cfg.model.init_from)
        args = weights.args
    else:
        rows = cfg.model.vocab_multiple * cfg.parallelism.tp_size
        args = model_args_for(cfg, vocab_size).padded(rows)
        weights = InitSource(args, cfg.train.seed)
    a = cfg.attention
    chosen = resolve_for(a, args, device=device, dtype=dtype, seq_len=cfg.data.seq_len)
    model = build_model(args, chosen.backend, chosen.kernel, a.reset_positions)
    return model, weights


def main(cfg: Config, env: RankEnv, lock_run_dir: bool = False, record: dict | None = None) -> dict:
    """Run training on this rank; every rank returns the same summary. ``lock_run_dir``:
    rank 0 takes the run-directory lock (under torchrun / Slurm, where no launcher of ours
    holds it), and every rank refuses if it is taken; rank 0 then writes ``record`` (the
    run's .hydra files, llm.runfiles.run_record). Signals are recorded from here to the end
    (llm.train.stop): a stop at any moment leaves the newest completed step saved."""
    with stop_guard() as stop:
        try:
            return _main(cfg, env, lock_run_dir, stop, record)
        except RuntimeError as exc:  # a collective's timeout: one line naming it
            prefix = Path(env.trace_prefix or trace_prefix(Path(cfg.output_dir)))
            line = collective_timeout(exc, env.rank, cfg.launcher.timeout_min, prefix)
            if line is None:
                raise
            raise TrainingError(line) from exc


def _main(
    cfg: Config, env: RankEnv, lock_run_dir: bool, stop: StopRequested, record: dict | None
) -> dict:
    device = resolve_device(cfg)
    if device.type == "cuda":
        # cuda:0 when this process sees one GPU (srun --gpus-per-task=1), its local rank's
        # when it sees the node's; refused here, before any rank starts NCCL, otherwise.
        device = rank_device(env, torch.cuda.device_count())
        torch.cuda.set_device(device)
    init_distributed(
        env,
        device,
        cfg.launcher.backend,
        env.world_size > 1 or cfg.parallelism.name != "single",
        cfg.launcher.timeout_min,
    )
    if dist.is_initialized() and env.world_size > 1 and not rehearsing():
        # Under torchrun/Slurm every rank ran Hydra and may have its own timestamped run
        # directory: rank 0's is the run's, and its train.log every rank's. A rehearsal
        # (llm.rehearse) is one process: its directory is the run's.
        shared = [cfg.output_dir]
        dist.broadcast_object_list(shared, src=0)
        cfg = dataclasses.replace(cfg, output_dir=shared[0])
        run_log_moves_to(Path(cfg.output_dir))
    t = cfg.train
    tracker = PeakTracker(device, t.memory_tracking, t.peak_tensors, t.allocator_blocks)
    lock = RunDirLock(Path(cfg.output_dir))
    try:
        if lock_run_dir:
            _lock_on_rank0(lock, env)
            if env.rank == 0:
                write_run_record(Path(cfg.output_dir), record)
        return _train(cfg, env, device, tracker, stop)
    finally:
        lock.release()
        tracker.end()  # a start-up that raised leaves its window open
        if dist.is_initialized():
            dist.destroy_process_group()


def _lock_on_rank0(lock: RunDirLock, env: RankEnv) -> None:
    refusal = None
    if env.rank == 0:
        try:
            lock.acquire()
        except ConfigError as exc:
            refusal = str(exc)
    refusal = gather_object(refusal)[0]  # every rank stops, not only rank 0
    if refusal is not None:
        raise ConfigError(refusal)


def _train(
    cfg: Config, env: RankEnv, device: torch.device, tracker: PeakTracker, stop: StopRequested
) -> dict:
    """The build in a fixed order (torchtitan's): everything up to wrap() happens on the meta
    device (no storage): the pipeline split, tensor parallel, recompute, precision, then
    wrap() shards over dp and allocates and fills only what this rank holds, so under pp,
    tp, zero3 and fsdp the unsharded model never exists on any rank. Compile comes after
    wrap. Then the loaders, the logger, the checkpointer and the Trainer's loop."""
    _seed(cfg.train)
    precision = precision_for(cfg, device)
    precision.apply_backend_flags()
    dims = _parallel_dims(cfg, env, device)
    prepared = _prepared_data(cfg, env)
    tracker.begin("startup")  # model build, wrap and optimizer: one phase of the peak tracker
    model, weights, attention = _model_on_meta(cfg, prepared.tokenizer, device, precision)
    args = model.args
    model, recompute = _parallelize_on_meta(model, cfg, dims, precision)
    scaler = build_loss_scaler(cfg.precision, precision.loss_scaling)
    strategy = build_strategy(cfg.parallelism, dims, precision, device, scaler, run_config=cfg)
    _install_expert_exchanges(model, strategy, weights, cfg, dims, device)
    model = _compile(strategy.wrap(model, weights), cfg.train)
    optimizer = strategy.build_optimizer(model, cfg.optimizer)
    tracker.watch(strategy.state_tensors)
    tracker.end()
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps)
    train_loader, val_loader = _loaders(prepared, cfg, dims, device)
    logger = _logger(cfg, env)
    _log_choices(logger, cfg, device, precision, attention, strategy)
    checkpointer = _checkpointer(cfg, env, args, prepared.tokenizer)
    trainer = Trainer(
        cfg=cfg,
        model=model,
        strategy=strategy,
        scheduler=scheduler,
        train_loader=train_loader,
        val_loader=val_loader,
        logger=logger,
        checkpointer=checkpointer,
        flops_per_token=_flops_per_token(args, cfg.data.seq_len),
        peak_flops=peak_flops(device, precision.flops_dtype),
        device=device,
        tracker=tracker,
        recompute=recompute,
        stop=stop,
    )
    try:
        if checkpointer is not None and (path := checkpointer.resolve(cfg.checkpoint.resume)):
            trainer.resume(path)
        summary = trainer.fit()
        summary.update(_run_facts(cfg, env, device, summary, args, dims, precision))
        summary.update(_choice_facts(attention, strategy))
        logger.summary(summary)
        return summary
    finally:
        strategy.close()
        logger.close()


def _prepared_data(cfg: Config, env: RankEnv) -> PreparedData:
    """The corpus and tokenizer, prepared once per node or once in all on a shared cache (a
    no-op when our launcher prepared; a rehearsal prepares alone)."""
    prepared = prepare_across_ranks(
        cfg.data, env.rank, env.local_rank, env.world_size, cfg.launcher.timeout_min
    )
    if env.rank == 0:
        save_tokenizer(prepared.tokenizer, Path(cfg.output_dir))  # llm.generate decodes with it
    return prepared


def _choice_facts(attention, strategy) -> dict:
    """summary.json's record of the attention backend taken and, for the nvme tier, every
    rank's files and bytes (one gather, at the end)."""
    facts = {"attention": attention.summary()}
    if (offload := strategy.offload_facts()) is not None:
        facts["offload"] = gather_object(offload)
    return facts


def _seed(train: TrainConfig) -> None:
    torch.manual_seed(train.seed)
    if train.deterministic:
        torch.use_deterministic_algorithms(True)


def _parallel_dims(cfg: Config, env: RankEnv, device: torch.device) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims.from_config(
        p.dp_size,
        p.tp_size,
        p.pp_size,
        env.world_size,
        env.rank,
        dp_replicate=p.replicate,
        device_type=device.type,
    )


def _model_on_meta(cfg: Config, tokenizer, device: torch.device, precision):
    """(the model on the meta device, its weight source, the attention pick): the same pick
    build_model_for made, kept for the log and the summary. Refuses a vocabulary smaller
    than the tokenizer's."""
    model, weights = build_model_for(cfg, tokenizer.vocab_size, device, precision.compute_dtype)
    args = model.args
    attention = resolve_for(
        cfg.attention, args, device=device, dtype=precision.compute_dtype, seq_len=cfg.data.seq_len
    )
    if args.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size={args.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}; set model.vocab_size or use another data.tokenizer"
        )
    return model, weights, attention


def _parallelize_on_meta(model, cfg: Config, dims: ParallelDims, precision):
    """Still on the meta device: this rank's pipeline stages (under the whole model's
    names), tensor parallel, frozen parameters, recompute and the precision's dtypes.
    Returns (the model, the recompute policy)."""
    if dims.pp_size > 1:
        layout = PipelineLayout.from_config(cfg.parallelism, model.args.n_layers)
        model = PipelinePart(model, layout, dims.pp_rank)
    if dims.tp_size > 1:
        model = apply_tensor_parallel(model, dims.tp_mesh(), cfg.parallelism.sequence_parallel)
    # Before any strategy sees which parameters train; a pipeline part holds some names only.
    freezer = model.freeze if isinstance(model, PipelinePart) else functools.partial(freeze, model)
    freezer(cfg.model.freeze)
    recompute = recompute_policy(cfg.recompute)
    model = apply_recompute(model, cfg.recompute, recompute)
    model = apply_precision(model, precision)  # bf16_pure: bf16 weights; fp8: float8 linears
    return model, recompute


def _install_expert_exchanges(model, strategy, weights, cfg: Config, dims, device) -> None:
    """Under data parallelism MoE layers route over the global batch; ep_size > 1 also cuts
    the experts to this rank's, which the strategy then holds apart."""
    if dims.dp_size > 1:
        ep = cfg.parallelism.ep_size
        mesh = expert_mesh(device.type, dims.dp_size, ep) if ep > 1 else None
        strategy.expert_shards = install_experts(model, dims.dp_group(), mesh, weights, device)


def _compile(model, train: TrainConfig):
    if not train.compile:
        return model
    mode = train.compile_mode
    return torch.compile(model, mode=None if mode == "default" else mode)


def _loaders(prepared, cfg: Config, dims: ParallelDims, device: torch.device):
    """(training loader, validation loader), each sharded by dp rank. The training one reads
    ahead on a thread; on CUDA pinned there, for the Trainer's asynchronous copy."""
    batch = cfg.train.micro_batch_size
    loader = build_train_loader(
        prepared, cfg.data, batch, dims.dp_rank, dims.dp_size, cfg.train.seed
    )
    train_loader = Prefetcher(loader, cfg.data.prefetch, device if device.type == "cuda" else None)
    val_loader = build_val_loader(prepared, cfg.data, batch, dims.dp_rank, dims.dp_size)
    return train_loader, val_loader


def _logger(cfg: Config, env: RankEnv) -> RunLogger | NullLogger:
    """Rank 0 logs; the others log nothing."""
    if env.rank != 0:
        return NullLogger()
    output_dir = Path(cfg.output_dir)
    run_config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return RunLogger(
        cfg.logger,
        output_dir,
        run_config,
        cfg.train.max_steps,
        run_name=output_dir.name
        if cfg.sweep_name is None
        else f"{cfg.sweep_name}/{output_dir.name}",
        group=cfg.logger.group or cfg.sweep_name,
    )


def _log_choices(logger, cfg: Config, device: torch.device, precision, attention, strategy):
    """The lines that say what the run picked or could not do on this device, and where the
    nvme tier keeps its files."""
    if attention.requested == "auto":
        logger.info(attention.why)
    if cfg.train.compile and cfg.train.compile_mode == "reduce-overhead" and device.type != "cuda":
        logger.info(
            f"train.compile_mode=reduce-overhead: CUDA graphs need a CUDA device; on "
            f"{device.type} the model compiles as under the default mode"
        )
    if precision.fp8_emulated:
        logger.info(
            f"fp8: the {precision.fp8_recipe} recipe runs emulated (fp8 quantised and "
            "dequantised, matmuls in fp32): its rounding and what backward keeps, not its speed"
        )
    _log_offload(logger, strategy)


def _log_offload(logger, strategy) -> None:
    """Where the nvme tier's files are (rank 0's), and whether direct I/O was used."""
    facts = strategy.offload_facts()
    for what in ("optimizer", "params") if facts else ():
        if what in facts:
            f = facts[what]
            logger.info(
                f"offload_{what}=nvme: {f['file_bytes'] / 2**20:.0f} MB in files under "
                f"{facts['nvme_path']} via {f['io']}, streamed through "
                f"{f['pool_bytes'] / 2**20:.0f} MB of host buffers"
            )


def _checkpointer(cfg: Config, env: RankEnv, args, tokenizer) -> Checkpointer | None:
    if not cfg.checkpoint.enabled:
        return None
    return Checkpointer(
        Path(cfg.output_dir) / "checkpoints",
        cfg.checkpoint.keep_last,
        shape_digest(args),
        env.world_size,
        file_bytes=int(cfg.checkpoint.file_mb * 2**20),
        describes={"model_args": dataclasses.asdict(args), "tokenizer_digest": tokenizer.digest},
    )


def _flops_per_token(args, seq_len: int) -> dict[str, float]:
    return {
        "mfu": flops_per_token(args, seq_len),
        "mfu_causal": causal_flops_per_token(args, seq_len),
    }


_PER_RANK = (
    "model_state_bytes",
    "comm_bytes_per_step",
    "memory_peak",
    "memory_peak_by_phase",
    "memory_peak_tensors",
    "memory_allocator_blocks",
    "cuda_max_allocated_bytes",
)
_HIGHEST = ("peak_memory_bytes", "max_peak_memory_bytes", "process_peak_rss_bytes")


def _rank_facts(summary: dict) -> dict:
    """Figures from every rank, in the run's one object gather at the end: per-rank lists
    (so rank 0's summary holds every rank's), and the highest peaks over ranks (None where
    no rank measured one: tracking off on CPU)."""
    ranks = gather_object({key: summary[key] for key in _PER_RANK + _HIGHEST})
    facts = {key: [r[key] for r in ranks] for key in _PER_RANK}
    if all(v is None for v in facts["cuda_max_allocated_bytes"]):
        del facts["cuda_max_allocated_bytes"]  # CPU
    for key in _HIGHEST:
        facts[key] = max((r[key] for r in ranks if r[key] is not None), default=None)
    return facts


def _run_facts(
    cfg: Config, env: RankEnv, device: torch.device, summary: dict, args, dims, precision
) -> dict:
    return {
        **_rank_facts(summary),
        "world_size": env.world_size,
        "dp_size": dims.dp_size,
        "tp_size": dims.tp_size,
        "pp_size": dims.pp_size,
        "ep_size": cfg.parallelism.ep_size,
        "strategy": cfg.parallelism.name,
        "precision": precision.name,
        # precision=fp8: its recipe, and whether it ran emulated (fp32 quantise-dequantise:
        # the recipe's rounding and what backward keeps, not its speed).
        "fp8_recipe": precision.fp8_recipe,
        "fp8_emulated": precision.fp8_emulated,
        "model": cfg.model.name,
        "n_params": num_params(args),
        # What a token multiplies: top_k of the routed experts (all of a dense model).
        "n_active_params": num_active_params(args),
        "device": str(device.type),
        "hardware": hardware(device),
        "git_sha": git_sha(),
        "config_digest": config_digest(cfg),
        "output_dir": str(Path(cfg.output_dir).resolve()),
    }
