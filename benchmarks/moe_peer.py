"""DeepSpeed-MoE as the library peer of our expert parallelism: the same model, data, steps
and ranks, with each MoE feed-forward either ours (llm/models/moe.py, experts split by
llm/parallel/experts/ under our ZeRO-2) or ``deepspeed.moe.layer.MoE`` (with its
ep_size) under DeepSpeed's ZeRO-2. ``benchmarks/strategies.py --moe-peer`` prints the table
"MoE: ours vs DeepSpeed-MoE"; this file alone runs that table only:

    python benchmarks/moe_peer.py --ranks 2,4               # = strategies.py --moe-peer, no other rows
    python benchmarks/moe_peer.py --ranks 4 --moe-ep 2,4    # 4 ranks at ep 2 (edp 2) and ep 4
    python benchmarks/strategies.py --ranks 2 --moe-peer    # the strategy rows, then this table

CPU ranks (gloo) in fp32 only: strategies.py refuses --moe-peer with another device or
precision. Rows per rank count N and expert-parallel size ep (--moe-ep, default ep = N): every
rank holds E / ep experts, and the edp = N / ep ranks that hold the same experts shard their
optimizer state (ours: zero2's second set of buckets; DeepSpeed: its expert param groups'
partitions over its expert data-parallel group):
- ours: ``train.py model=moe-tiny parallelism=zero2 parallelism.ep_size=ep`` through the
  strategies table's own job runner, benchmarks/strategy_runs.py (a timing pass, then a
  measuring pass with parallelism.count_comm and the peak tracker on every step).
- deepspeed-moe: the same Transformer (llm.models, the same seeded init) whose blocks'
  ``feed_forward`` is a :class:`DeepSpeedFeedForward`: DeepSpeed's MoE(hidden_size=d_model,
  expert=a SwiGLU of width d_expert, num_experts=E, ep_size=ep, k=top_k, use_residual=False,
  top2_2nd_expert_sampling=False), its gate and experts loaded with our init's router and
  expert weights (so step 1 computes the same forward), its l_aux times our aux_loss_coef
  added to the loss; trained by ``deepspeed.initialize`` (ZeRO stage 2, fp32, the ds_config
  our parallelism=deepspeed builds: torch's AdamW, the same lr, betas, clipping) over our
  param groups split by ``split_params_into_different_moe_groups_for_optimizer``, with our
  LambdaLR on the optimizer DeepSpeed steps, on the batches our loader gives each rank. Two
  dropless settings (this layer has no per-token dropless path: it always dispatches an
  (E, C, d) buffer of C slots per expert; DeepSpeed's separate AutoEP, module_inject/auto_ep*,
  sends uneven splits and is not what these rows run):
    - ``drop_tokens=False``: C = the largest expert count of any rank in the ep group (one
      all-reduce MAX per layer), so the buffer follows the routing's worst expert;
    - ``capacity_factor=E/k``: C = ceil(tokens/E * capacity_factor * 2) = the rank's tokens,
      the smallest fixed capacity that can drop nothing; the buffer never depends on routing.
  Each is run as our rows are: a subprocess (``--worker``) that spawns N gloo ranks, a timing
  pass and a measuring pass (counting and peak tracking on), each from the same init.

Measured per row: the median of rank 0's step time after --warmup steps (data, forward,
backward, optimizer step, scheduler: what our Trainer's step_time_s brackets); all-to-all
bytes per step per rank (ours: the exchange's own count; DeepSpeed: every
``torch.distributed.all_to_all_single`` during the measured steps, counted by a wrapper as the
input bytes that go to other ranks); each rank's peak of live tensor bytes in a step (the peak
tracker, llm/memory/peak.py, every step, params / grads / optimizer states classified by the
same state_tensors() our parallelism=deepspeed rows use), its optimizer-state bytes beside what
the edp sharding should leave (benchmarks/moe_peer_table.py); the training loss at step 1 and
after the timing pass's steps.

DeepSpeed's all-to-all bytes follow from its capacity alone: per MoE layer and step, the
dispatch and combine buffers (E x C x d elements) cross the ep group forward and again
backward, (ep - 1) / ep of each leaving the rank:
``4 x (ep - 1) / ep x E x C x d x element size`` (:func:`deepspeed_a2a_bytes`). Ours moves the
rows that leave their rank, ``2 x (S_out + R_in) x d x element size`` per layer and rank
(docs/parallel.md): routing-dependent.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

# DeepSpeed settings, each dropless: key -> (row label, description)
DS_MODES = {
    "dropless": "deepspeed-moe drop_tokens=False",
    "full_capacity": "deepspeed-moe capacity_factor=E/k",
}
DEFAULT_DS_MODES = "dropless,full_capacity"


# ---- DeepSpeed's side, inside each rank ----------------------------------------------------
class SwiGLUExpert(nn.Module):
    """One expert as ours computes it: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_hidden, bias=False)
        self.w3 = nn.Linear(d_model, d_hidden, bias=False)
        self.w2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DeepSpeedFeedForward(nn.Module):
    """A block's feed-forward as DeepSpeed's MoE: returns the output alone and keeps the
    layer's l_aux (added to the loss by the loop) and its expert counts (this rank's
    assignments per expert, before any drop)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, self.exp_counts = self.moe(x)
        return out


def ds_capacity_factor(mode: str, n_experts: int, top_k: int) -> tuple[float, bool]:
    """(capacity_factor, drop_tokens) of a DS_MODES setting."""
    if mode == "dropless":
        return 1.0, False  # the factor is unused without drops
    if mode == "full_capacity":
        return n_experts / top_k, True
    raise ValueError(f"unknown DeepSpeed-MoE mode {mode!r}; use one of {', '.join(DS_MODES)}")


def deepspeed_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """DeepSpeed's ``_capacity`` for top-2 gating with drop_tokens (sharded_moe.py):
    ceil(tokens / E * capacity_factor * 2), at least min_capacity (4)."""
    if top_k != 2:
        raise ValueError("DeepSpeed's top-2 gate is the one modelled here")
    return max(math.ceil(tokens / n_experts * capacity_factor * 2), 4)


def deepspeed_a2a_bytes(
    capacities: list[int], n_experts: int, d_model: int, ep: int, itemsize: int
) -> float:
    """All-to-all bytes one rank sends per step: per MoE layer of capacity C, the (E, C, d)
    dispatch and combine buffers forward and their gradients backward, (ep - 1) / ep of each
    to other ranks."""
    return sum(4 * (ep - 1) / ep * n_experts * c * d_model * itemsize for c in capacities)


def swap_in_deepspeed_moe(model: nn.Module, ep: int, ep_rank: int, mode: str) -> list:
    """Replace each MoE feed-forward of ``model`` (materialised) by DeepSpeed's MoE, its gate
    and this rank's experts copied from ours (experts [ep_rank * E / ep, ...) as DeepSpeed
    places them). Returns the new feed-forwards."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from llm.models.moe import MoE

    layers = []
    for block in model.layers:
        ours = block.feed_forward
        if not isinstance(ours, MoE):
            continue
        moe, d = ours.moe, model.args.d_model
        if moe.router != "softmax" or not moe.norm_topk or moe.n_shared_experts:
            raise SystemExit(
                "the DeepSpeed peer models softmax top-k, normalised, no shared experts"
            )
        factor, drop = ds_capacity_factor(mode, moe.n_experts, moe.top_k)
        ds = DeepSpeedMoE(
            hidden_size=d,
            expert=SwiGLUExpert(d, model.args.d_expert),
            num_experts=moe.n_experts,
            ep_size=ep,
            k=moe.top_k,
            capacity_factor=factor,
            eval_capacity_factor=factor,
            drop_tokens=drop,
            use_residual=False,
            top2_2nd_expert_sampling=False,  # ours picks the top 2, no Gumbel noise
        )
        local = moe.n_experts // ep
        with torch.no_grad():
            ds.deepspeed_moe.gate.wg.weight.copy_(ours.router.gate.weight)
            for i, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * local + i
                expert.w1.weight.copy_(ours.experts.w1[e])
                expert.w3.weight.copy_(ours.experts.w3[e])
                expert.w2.weight.copy_(ours.experts.w2[e])
        block.feed_forward = DeepSpeedFeedForward(ds)
        layers.append(block.feed_forward)
    return layers


class AllToAllCounter:
    """While open, wraps ``torch.distributed.all_to_all_single`` (DeepSpeed's comm calls it
    through the module attribute) and adds up the input bytes each call sends to other
    ranks: its own split stays."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = None

    def __enter__(self) -> AllToAllCounter:
        import torch.distributed as dist

        self._original = original = dist.all_to_all_single

        def counted(
            output,
            input,
            output_split_sizes=None,
            input_split_sizes=None,
            group=None,
            async_op=False,
        ):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            total = input.numel() * input.element_size()
            if input_split_sizes:
                row = total // max(input.size(0), 1)
                self.bytes += (sum(input_split_sizes) - input_split_sizes[me]) * row
            else:
                self.bytes += total - total // n
            return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from llm.config import register_configs, to_dataclass

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_dataclass(compose(config_name="config", overrides=overrides))


def _rank_main(rank: int, spec: dict) -> None:
    """One gloo rank of a DeepSpeed-MoE pass; rank 0 writes ``spec['out']``."""
    world = spec["ranks"]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(spec["threads"])
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = _train_deepspeed_moe(rank, world, spec)
    every = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        out = {**every[0], "per_rank": [r["mine"] for r in every]}
        Path(spec["out"]).write_text(json.dumps(out, indent=2))
    dist.barrier()
    # Done, and the result is on disk: leave without the process groups' and the
    # interpreter's teardown, where a gloo or DeepSpeed thread still joinable at exit aborts
    # a rank now and then ("terminate called without an active exception", SIGABRT; seen
    # once in 3 passes). An exception above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_deepspeed_moe(rank: int, world: int, spec: dict) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups as ds_groups

    from llm.data import IGNORE, build_train_loader, prepare_data
    from llm.memory import ActivationMemoryCounter, PeakTracker, find_layers
    from llm.models import materialize_from
    from llm.optim import build_scheduler, optimizer_param_groups
    from llm.parallel.deepspeed import DeepSpeedStrategy
    from llm.parallel.ds_config import checked_ds_config
    from llm.precision import resolve_precision
    from llm.run import build_model_for

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = _compose(spec["overrides"])
    device = torch.device("cpu")
    ep, mode, measure = spec["ep"], spec["mode"], spec["measure"]
    torch.manual_seed(cfg.train.seed)
    precision = resolve_precision(cfg.precision.name, device)
    if rank == 0:
        prepared = prepare_data(cfg.data)
    dist.barrier()
    if rank != 0:
        prepared = prepare_data(cfg.data)
    model, weights = build_model_for(cfg, prepared.tokenizer.vocab_size)
    materialize_from(model, weights, device)
    args = model.args
    layers = swap_in_deepspeed_moe(model, ep, rank % ep, mode)
    groups = optimizer_param_groups(model, cfg.optimizer)
    for g in groups:
        g["name"] = g["kind"]
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    ds_config = checked_ds_config(cfg, precision, device, world, args.d_model)
    ds_config["comms_logger"] = {"enabled": False}  # the wrapper counts the all-to-alls
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, config=ds_config, dist_init_required=False
    )
    name = layers[0].moe.expert_group_name
    if ds_groups._get_expert_parallel_rank(name) != rank % ep:
        raise RuntimeError("DeepSpeed placed this rank's experts elsewhere than assumed")
    optimizer = engine.basic_optimizer
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps)
    loader = build_train_loader(
        prepared, cfg.data, cfg.train.micro_batch_size, rank, world, cfg.train.seed
    )

    # The peak tracker classifies what the engine holds as our deepspeed rows do.
    class _Held(DeepSpeedStrategy):
        def __init__(self) -> None:
            self.engine, self.inner = engine, optimizer
            self.cfg = type("Cfg", (), {"zero_stage": 2})()

    tracker = PeakTracker(device, "alternate" if measure else "off")
    tracker.watch(_Held().state_tensors)
    coef = args.moe.aux_loss_coef
    blocks = find_layers(engine.module)
    step_times, losses, norms, sent, capacities = [], [], [], [], []
    counter = AllToAllCounter()
    for _ in range(cfg.train.max_steps):
        start = time.perf_counter()
        x, y, _docs = next(loader)
        tokens = (y != IGNORE).sum().to(torch.float64)
        dist.all_reduce(tokens)  # the global target count, as our Trainer's step reduces it
        scale = (world / tokens.clamp(min=1.0)).float()
        before = counter.bytes
        with tracker.step(measure), counter if measure else nullcontext():
            tracker.phase("forward")
            # As our Trainer on a logged step (train.log_every=1: every step), whose saved-
            # tensor hooks count the forward's activations: the same cost per op in both rows.
            with ActivationMemoryCounter(blocks):
                logits = engine(x)
                loss = F.cross_entropy(
                    logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum"
                )
            tracker.phase("backward")
            scaled = loss * scale + coef * sum(layer.l_aux for layer in layers)
            tracker.watch_backward(scaled)
            engine.backward(scaled, scale_wrt_gas=False)
            tracker.phase("optimizer_step")
            engine.step()
            scheduler.step()
        step_times.append(time.perf_counter() - start)
        loss_sum = loss.detach().to(torch.float64)
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum / tokens))
        norms.append(float(engine.get_global_grad_norm()))
        if measure:
            sent.append(counter.bytes - before)
            capacities.append(_capacities(layers, mode, args, x.numel(), name))
    mine = {"a2a_bytes_per_step": sent, "memory_peak": tracker.best_step, "capacities": capacities}
    return {
        "ok": True,
        "step_times_s": step_times,
        "losses": losses,
        "grad_norms": norms,  # DeepSpeed's clipping norm
        "params_on_rank": sum(p.numel() for p in engine.module.parameters()),
        "d_model": args.d_model,
        "n_experts": args.moe.n_experts,
        "top_k": args.moe.top_k,
        "moe_layers": len(layers),
        "itemsize": precision.working_dtype.itemsize,
        "tokens_per_rank": cfg.train.micro_batch_size * cfg.data.seq_len,
        "mine": mine,
    }


def _capacities(layers: list, mode: str, args, tokens: int, group_name: str) -> list[int]:
    """Each layer's capacity in the step just run, by DeepSpeed's rule: drop_tokens=False
    takes the largest expert count over the ep group (an all-reduce MAX, here outside the
    timed steps); a fixed factor the formula of the rank's tokens."""
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    if mode != "dropless":
        factor, _ = ds_capacity_factor(mode, args.moe.n_experts, args.moe.top_k)
        return [deepspeed_capacity(tokens, args.moe.n_experts, args.moe.top_k, factor)] * len(
            layers
        )
    group = ds_groups._get_expert_parallel_group(group_name)
    out = []
    for layer in layers:
        biggest = layer.exp_counts.max().reshape(1).clone()
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
        out.append(int(biggest))
    return out


def _worker(spec_path: str) -> None:
    import torch.multiprocessing as mp

    spec = json.loads(Path(spec_path).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["port"] = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(spec,), nprocs=spec["ranks"], start_method="spawn")


# ---- the rows ---------------------------------------------------------------------------
def moe_namespace(a: argparse.Namespace, ep: int | None) -> argparse.Namespace:
    """strategies.py's options for a MoE row: its model and sequence length, ``ep_size``
    where ours splits the experts (DeepSpeed's rows set theirs in the layer)."""
    b = copy.copy(a)
    b.model, b.seq_len = a.moe_model, a.moe_seq_len
    b.set = [*a.set, *([f"parallelism.ep_size={ep}"] if ep else [])]
    return b


def moe_pairs(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(ranks, ep) of every MoE row: each --moe-ep at each --ranks count, ep = ranks
    without --moe-ep."""
    return [(n, ep) for n in a.rank_counts for ep in (a.moe_eps or [n])]


def param_split(a: argparse.Namespace) -> tuple[int, int]:
    """(dense, expert) parameter elements of the MoE rows' model, built on the meta device
    from the rows' own config (every MoE layer's experts, all of them, count as expert)."""
    import strategy_runs as runs

    from llm.build.model_args import tokenizer_vocab_size
    from llm.models.moe import MoE
    from llm.run import build_model_for

    job = runs.Job("zero2", 1, a.precision)
    overrides = runs.overrides(moe_namespace(a, None), job, Path("unused"), False)
    cfg = _compose([*(o for o in overrides if not o.startswith("hydra.")), "output_dir=unused"])
    model, _ = build_model_for(cfg, tokenizer_vocab_size(cfg))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()
    )
    return total - experts, experts


def _ours_pass(a: argparse.Namespace, ranks: int, ep: int, root: Path, measure: bool) -> dict:
    import strategy_runs as runs

    b = moe_namespace(a, ep)
    job = runs.Job("zero2", ranks, a.precision)
    row = runs.run_pass(b, job, root, measure)
    if not row["ok"]:
        return row
    run_dir = Path(row["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    if not measure:
        metrics = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        losses = [m["loss"] for m in metrics if "loss" in m and "step" in m]
        norms = [m["grad_norm"] for m in metrics if "grad_norm" in m]
        return {**row, "losses": losses, "grad_norms": norms}
    return {
        **row,
        "a2a_bytes_per_rank": [c.get("all_to_all", 0.0) for c in summary["comm_bytes_per_step"]],
        "peak_bytes_per_rank": [p["total"] for p in summary["memory_peak"]],
        "memory_peak": summary["memory_peak"],
        "n_params": summary["n_params"],
        "hardware": summary.get("hardware"),
    }


def _deepspeed_pass(
    a: argparse.Namespace, ranks: int, ep: int, mode: str, root: Path, measure: bool
) -> dict:
    import strategy_runs as runs

    kind = "measure" if measure else "time"
    root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"dsmoe-{mode}-{ranks}-ep{ep}-{kind}-", dir=root))
    b = moe_namespace(a, None)
    job = runs.Job("deepspeed2", ranks, a.precision)
    overrides = [o for o in runs.overrides(b, job, run_dir, measure) if not o.startswith("hydra.")]
    threads = runs.threads_per_rank(a, ranks)
    spec = {
        "ranks": ranks,
        "ep": ep,
        "mode": mode,
        "measure": measure,
        "threads": threads,
        "overrides": [*overrides, f"output_dir={run_dir}"],
        "out": str(run_dir / "result.json"),
    }
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    row = {"ok": False, "error": None, "run_dir": str(run_dir)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(run_dir / "spec.json")]
    rc = runs.run_timed(cmd, run_dir, threads, a.timeout, row)
    if rc is None:
        row["error"] = f"timed out after {a.timeout} s"
        return row
    out = run_dir / "result.json"
    if rc != 0 or not out.exists():
        row["error"] = runs.one_line_error((run_dir / "bench.log").read_text(errors="replace"))
        return row
    result = json.loads(out.read_text())
    row.update(ok=True, losses=result["losses"], grad_norms=result["grad_norms"])
    row["params_on_rank0"] = result["params_on_rank"]
    if not measure:
        return {**row, **_timings(a, result["step_times_s"])}
    per_rank = result["per_rank"]
    row["a2a_bytes_per_rank"] = [statistics.mean(r["a2a_bytes_per_step"]) for r in per_rank]
    row["peak_bytes_per_rank"] = [r["memory_peak"]["total"] for r in per_rank]
    row["memory_peak"] = [r["memory_peak"] for r in per_rank]
    # The formula from each rank's capacities per step: its ep group's, which differ between
    # ep groups when ep < ranks (drop_tokens=False takes the group's largest expert count).
    capacities = [r["capacities"] for r in per_rank]
    shape = result["n_experts"], result["d_model"], ep, result["itemsize"]
    row["formula_a2a_bytes_per_rank"] = [
        statistics.mean(deepspeed_a2a_bytes(c, *shape) for c in steps) for steps in capacities
    ]
    row["capacities"] = capacities
    row.update(tokens_per_rank=result["tokens_per_rank"], d_model=result["d_model"])
    row.update(n_experts=result["n_experts"], itemsize=result["itemsize"])
    return row


def _timings(a: argparse.Namespace, times: list[float]) -> dict:
    kept = times[a.warmup :]
    median = statistics.median(kept)
    return {
        "step_times_s": kept,
        "median_ms": median * 1e3,
        "min_ms": min(kept) * 1e3,
        "tokens_per_s": a.global_batch * a.moe_seq_len / median,
    }


# What the timing pass contributes to a row; everything else comes from the measuring pass.
TIMED = (
    "step_times_s",
    "median_ms",
    "min_ms",
    "tokens_per_s",
    "wall_s",
    "others_cpu",
    "losses",
    "grad_norms",
)


def run_row(
    a: argparse.Namespace, ranks: int, ep: int, impl: str, root: Path, split: tuple[int, int]
) -> dict:
    """One row: ``impl`` "ours" or a DS_MODES key at ``ranks`` and ``ep``; the timing pass,
    then the measuring pass. ``split``: the model's (dense, expert) parameter elements, for
    the optimizer-state bytes the row should hold."""
    from moe_peer_table import OPTIMIZER_BYTES, expected_optimizer_bytes, side

    def one(measure: bool) -> dict:
        if impl == "ours":
            return _ours_pass(a, ranks, ep, root, measure)
        return _deepspeed_pass(a, ranks, ep, impl, root, measure)

    head = {
        "ranks": ranks,
        "ep": ep,
        "impl": impl,
        "label": "ours zero2" if impl == "ours" else DS_MODES[impl],
        "dense_params": split[0],
        "expert_params": split[1],
        "expected_optimizer_bytes": expected_optimizer_bytes(
            *split, ranks, ep, OPTIMIZER_BYTES[side(impl)]
        ),
    }
    timed = one(False)
    if not timed["ok"]:
        return {**head, **timed}
    measured = one(True)
    if not measured["ok"]:
        return {**head, **timed, "ok": False, "error": f"measuring pass: {measured['error']}"}
    return {**head, **measured, **{k: v for k, v in timed.items() if k in TIMED}}


def run_rows(a: argparse.Namespace, root: Path) -> list[dict]:
    """Every MoE row at each rank count, each re-taken (once per --retakes) where other
    processes used more than --retake-above cores meanwhile."""
    import strategy_runs as runs

    impls = ["ours", *a.moe_ds_modes]
    split = param_split(a)
    rows = []
    for ranks, ep in moe_pairs(a):
        for impl in impls:
            r = run_row(a, ranks, ep, impl, root, split)
            for _ in range(a.retakes):
                if not r["ok"] or r["others_cpu"] <= a.retake_above:
                    break
                runs.wait_for_quiet(a)
                again = run_row(a, ranks, ep, impl, root, split)
                if again["ok"] and again["others_cpu"] < r["others_cpu"]:
                    r = again
            status = f"{r['median_ms']:.0f} ms" if r["ok"] else f"failed: {r['error']}"
            print(f"moe {ranks} ranks ep {ep} {r['label']}: {status}", flush=True)
            rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    """``strategies.py --moe-peer`` with no strategy or layout rows, run as that script (it
    imports this module for the MoE rows, so this one does not import it back); a rank of
    DeepSpeed's rows with ``--worker``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return
    cmd = [sys.executable, str(BENCHMARKS / "strategies.py")]
    rc = subprocess.call([*cmd, "--strategies=", "--layouts=none", "--moe-peer", *argv])
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    main()
