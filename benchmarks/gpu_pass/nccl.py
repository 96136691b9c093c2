"""Every parallel strategy on NCCL at world size 1, and on two ranks of the one GPU through
gloo, each trained by train.py's code on gpt2-tiny (moe-tiny for expert parallel) from the
same seed and data as ``parallelism=single``, its every step's loss against single's; and
the host syncs of each step under ``torch.cuda.set_sync_debug_mode("warn")``.

One process runs the world-size-1 rows in turn (llm.launch: each run joins a fresh process
group and destroys it at its end), while two spawned processes run the two-rank rows on the
same GPU: they first try each collective the strategies use on a CUDA tensor over gloo, and
train only the strategies whose collectives all ran (benchmarks/gpu_pass/nccl_runs.py). The
dry run does the same on CPU with gloo, smaller.

Tolerance: bf16's machine epsilon, 2^-7 (0.78%) relative. The runs compute matmuls in bf16
(precision=auto on a GPU): a strategy that flattens, shards or reduces its fp32 gradients in
another order rounds differently by an fp32 ulp, which moves a bf16 cast of the next step's
weights by up to a bf16 ulp; a loss within one bf16 epsilon of single's is as equal as two
bf16 computations of it can be expected to be, while a wrong reduction (a missing or doubled
gradient, a lost shard) moves it by far more within 20 steps.
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.gpu_pass.common import Goal, Result, deadline, device, write_partial_rows
from benchmarks.gpu_pass.estimator import small_corpus
from benchmarks.gpu_pass.nccl_runs import PairPlan, Trace, first_line, one_rank, pair_rank
from llm.train.probes import ProbeSchedule

TOLERANCE = 2.0**-7
GPU = {"seq_len": 128, "batch": 8, "steps": 20, "log_every": 5}
DRY = {"seq_len": 64, "batch": 4, "steps": 6, "log_every": 3}
NOT_ON_CPU = "n/a (CPU)"
COLUMNS = ["strategy", "backend", "world_size", "steps", "max_rel_loss_diff", "within_tolerance",
           "syncs_per_non_logged_step", "syncs_per_logged_step", "note"]  # fmt: skip


@dataclass(frozen=True)
class Strategy:
    label: str
    model: str  # the model of its reference run: single on the same model
    overrides: tuple[str, ...]
    needs: tuple[str, ...] = ()  # the collectives its two-rank run makes (nccl_runs.COLLECTIVES)
    dry: bool = False  # in the dry run too (which keeps to one of each kind, to stay short)

    @property
    def deepspeed(self) -> bool:
        return "deepspeed" in self.label


DENSE, MOE = "gpt2-tiny", "moe-tiny"
REFERENCES = {DENSE: Strategy("single", DENSE, ()), MOE: Strategy("single moe", MOE, ())}
SHARDED = ("all_reduce", "all_gather", "reduce_scatter")
WORLD_1 = [
    Strategy("ddp", DENSE, ("parallelism=ddp",), dry=True),
    Strategy("zero1", DENSE, ("parallelism=zero1",)),
    Strategy("zero2", DENSE, ("parallelism=zero2",)),
    Strategy("zero3", DENSE, ("parallelism=zero3",), dry=True),
    Strategy("fsdp", DENSE, ("parallelism=fsdp",)),
    Strategy("deepspeed1", DENSE, ("parallelism=deepspeed1",)),
    Strategy("deepspeed2", DENSE, ("parallelism=deepspeed2",)),
    Strategy("deepspeed3", DENSE, ("parallelism=deepspeed3",)),
    Strategy("ep 1", MOE, ("parallelism=ddp", "parallelism.ep_size=1"), dry=True),
]
WORLD_2 = [
    Strategy("ddp", DENSE, ("parallelism=ddp",), ("all_reduce", "broadcast"), dry=True),
    Strategy("zero1", DENSE, ("parallelism=zero1",), SHARDED),
    Strategy("zero2", DENSE, ("parallelism=zero2",), SHARDED, dry=True),
    Strategy("zero3", DENSE, ("parallelism=zero3",), SHARDED),
    Strategy("fsdp", DENSE, ("parallelism=fsdp",), SHARDED),
    Strategy("hsdp", DENSE, ("parallelism=fsdp", "parallelism.replicate=2"), SHARDED),
    Strategy("deepspeed2", DENSE, ("parallelism=deepspeed2",), SHARDED),
    Strategy("ep 1", MOE, ("parallelism=ddp", "parallelism.ep_size=1"),
             ("all_reduce", "broadcast", "all_gather")),
    Strategy("ep 2", MOE, ("parallelism=ddp", "parallelism.ep_size=2"),
             ("all_reduce", "broadcast", "all_gather", "all_to_all"), dry=True),
]  # fmt: skip
NOTES = [
    f"tolerance: {TOLERANCE:.4g} relative (bf16's machine epsilon, 2^-7): the matmuls run in "
    "bf16 on the GPU, so a strategy that reduces its fp32 gradients in another order may move "
    "a bf16 weight by one ulp; the dry run (fp32 on CPU) is held to the same bound",
    "tp 1 and pp 1: not run, their code path is single's: llm/run.py splits the model into "
    "pipeline stages only when pp_size > 1 and applies tensor parallel only when tp_size > 1, "
    "so parallelism=single with tp_size=pp_size=1 is the reference run itself",
    "HSDP at world size 1: not run, parallelism.replicate=2 needs two ranks (one per replica); "
    "its row is a two-rank one",
    "ep 1 at world size 1 is ddp on moe-tiny: llm/run.py installs the expert exchanges only when "
    "dp_size > 1; they run in the two-rank rows (ep 1: counts all-gathered, ep 2: all-to-all)",
    "two ranks on one GPU: launcher.nproc_per_node=2 is refused with one GPU visible "
    "(llm/validate/), and the local launcher puts rank 1 on cuda:1; no config override "
    "changes either, so this section starts both ranks as torchrun or Slurm's one-GPU-per-task "
    "binding would (local_rank 0 each, validate given world_size=2) and runs llm.run.main",
    "syncs are counted per step from the start of one step to the start of the next; the last "
    "step (followed by the final evaluation) is left out of both averages",
]


def settings(dry: bool) -> dict:
    return DRY if dry else GPU


def chosen(strategies: list[Strategy], dry: bool) -> list[Strategy]:
    """Every strategy on the GPU; the dry run's few (DeepSpeed's CPU backend alone builds a
    shared-memory op on first use, for seconds)."""
    return [s for s in strategies if s.dry or not dry]


def overrides(s: Strategy, work: Path, corpus: Path, world: int, dry: bool) -> list[str]:
    """train.py's overrides for ``s`` on ``world`` ranks: a global batch of ``batch``
    sequences however many ranks share it, so every run sees single's batches."""
    cfg = settings(dry)
    name = f"w{world}-{s.label.replace(' ', '_')}"
    return [
        f"output_dir={work / name}",
        f"model={s.model}",
        "data=files",
        f"data.path={corpus}",
        f"data.cache_dir={work / 'cache'}",
        "data.tokenizer=byte",
        f"data.seq_len={cfg['seq_len']}",
        "data.val_samples=8",
        f"train.device={'cpu' if dry else 'cuda'}",
        f"train.max_steps={cfg['steps']}",
        f"train.micro_batch_size={cfg['batch'] // world}",
        f"train.log_every={cfg['log_every']}",
        "train.eval_every=1000",
        "scheduler.warmup_steps=2",
        "logger=none",
        "logger.progress=false",
        "checkpoint.enabled=false",
        f"launcher.backend={'gloo' if dry or world > 1 else 'nccl'}",
        *s.overrides,
    ]


def max_rel_diff(losses: dict[int, float], reference: dict[int, float]) -> float | None:
    """The largest |loss - reference| / |reference| over the steps; None where the two did
    not record the same steps (a run cut short)."""
    if not reference or set(losses) != set(reference):
        return None
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference)


def sync_counts(trace: Trace, dry: bool) -> tuple[float | str, float | str, str | None]:
    """(syncs per non-logged step, per logged step, which non-logged steps synced and the
    lines that did, most frequent first; None where none did); the last step is left out
    (its window holds the final evaluation)."""
    if dry:
        return NOT_ON_CPU, NOT_ON_CPU, None
    cfg = settings(dry)
    schedule = ProbeSchedule("logged", cfg["log_every"], cfg["steps"])
    steps = range(1, cfg["steps"])
    quiet = [s for s in steps if not schedule.logs(s)]
    logged = [s for s in steps if schedule.logs(s)]
    per_step = {s: len(trace.syncs.get(s, [])) for s in steps}
    sites = Counter(site for s in quiet for site in trace.syncs.get(s, []))
    synced = [f"{s} ({per_step[s]})" for s in quiet if per_step[s]]
    where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(3))
    return (
        statistics.mean(per_step[s] for s in quiet),
        statistics.mean(per_step[s] for s in logged),
        f"steps {', '.join(synced)} of {len(quiet)}, at {where}" if synced else None,
    )


def row(s: Strategy, backend: str, world: int, losses: dict[int, float] | None,
        reference: dict[int, float], note: str = "") -> dict:  # fmt: skip
    """A table row; ``losses`` None: the strategy did not run (``note`` says why)."""
    diff = None if losses is None else max_rel_diff(losses, reference)
    if losses is not None and diff is None:
        note = note or f"recorded steps {sorted(losses)} differ from single's"
    return {
        "strategy": s.label,
        "backend": backend,
        "world_size": world,
        "steps": None if losses is None else len(losses),
        "max_rel_loss_diff": diff,
        "within_tolerance": None if diff is None else diff <= TOLERANCE,
        "syncs_per_non_logged_step": None,
        "syncs_per_logged_step": None,
        "note": note,
        "ran": losses is not None,
    }


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here (its import's error), or None."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an import may fail in many ways (missing ops, CUDA, deps)
        return f"not run: deepspeed does not import here ({first_line(exc)})"
    return None


def free_ports(n: int, start: int = 20000, stop: int = 32000) -> list[int]:
    """``n`` ports free now below Linux's ephemeral range (32768 up), so none of them is one
    the runs of this process are handed meanwhile (llm.launch.launcher.free_port binds port
    0)."""
    ports = []
    for port in range(start, stop):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise SystemExit(f"no {n} free ports in {start}..{stop}; free some and run again")


def start_pair(work: Path, corpus: Path, dry: bool, ds_missing: str | None):
    """The two-rank runs, started in two spawned processes (they run while this process
    runs the world-size-1 rows); returns (their processes, where rank 0 writes)."""
    runs = [s for s in chosen(WORLD_2, dry) if not (s.deepspeed and ds_missing)]
    out = work / "pair.json"
    plan = PairPlan(
        ports=free_ports(len(runs) + 1),
        runs=[(s.label, list(s.needs), overrides(s, work, corpus, 2, dry)) for s in runs],
        out=str(out),
        backend="gloo",
        device="cpu" if dry else "cuda",
    )
    context = mp.start_processes(pair_rank, args=(plan,), nprocs=2, join=False,
                                 start_method="spawn")  # fmt: skip
    return context, out


def finish_pair(context, stop_at: float) -> str | None:
    """Wait for the two ranks until ``stop_at``; None when both ended well, else why not
    (they are ended then)."""
    try:
        while not context.join(timeout=max(stop_at - time.monotonic(), 0.1)):
            if time.monotonic() >= stop_at:
                for p in context.processes:
                    p.kill()
                return "the two ranks ran out of time"
    except mp.ProcessException as exc:
        return f"a rank failed: {first_line(exc)}"
    return None


def pair_rows(found: dict, references: dict, why_unfinished: str | None,
              ds_missing: str | None, dry: bool) -> tuple[list[dict], list[str]]:  # fmt: skip
    """The two-rank rows from what rank 0 wrote, and a note on the collectives probed."""
    probe = found.get("probe", {})
    runs = found.get("runs", {})
    rows = []
    for s in chosen(WORLD_2, dry):
        ref = references.get(s.model, {})
        got = runs.get(s.label)
        if s.deepspeed and ds_missing:
            rows.append(row(s, "gloo", 2, None, ref, ds_missing))
        elif got is None:
            rows.append(row(s, "gloo", 2, None, ref, f"not run: {why_unfinished or 'no result'}"))
        elif "skipped" in got:
            why = "; ".join(f"{n}: {probe[n]}" for n in got["skipped"])
            rows.append(row(s, "gloo", 2, None, ref, f"not run: gloo on this device fails {why}"))
        elif "error" in got:
            rows.append({**row(s, "gloo", 2, None, ref, f"failed: {got['error']}"), "ran": True})
        else:
            losses = {int(k): v for k, v in got["losses"].items()}
            rows.append(row(s, "gloo", 2, losses, ref))
    ok = [n for n, err in probe.items() if err is None]
    failing = [f"{n} ({err})" for n, err in probe.items() if err is not None]
    note = (
        f"gloo collectives on this device's tensors, tried with two ranks: ran {', '.join(ok) or 'none'}"
        f"; failed {', '.join(failing) or 'none'}"
        if probe
        else f"the two ranks probed no collective: {why_unfinished or 'no result'}"
    )
    return rows, [note]


def _judge(name: str, target: str, bad: list[str], judged: int, not_run: list[str]) -> Goal:
    """Missed where any row is ``bad``; met where every row was judged and none is; not
    judged where some rows that should have run did not; not measured where none ran."""
    if not judged:
        return Goal.unmeasured(name, target)
    if bad:
        return Goal(name, target, "; ".join(bad), False)
    if not_run:
        return Goal(name, target, f"{judged} rows pass; not run: {', '.join(not_run)}", None)
    return Goal(name, target, f"all {judged} rows", True)


def goals(rows: list[dict], dry: bool) -> list[Goal]:
    # Rows at world size 1 should all run; a two-rank row gloo cannot run is by design.
    not_run = [f"{r['strategy']} (w{r['world_size']})" for r in rows
               if not r["ran"] and r["world_size"] == 1]  # fmt: skip
    compared = [r for r in rows if r["ran"] and r["strategy"] not in ("single", "single moe")]
    off = [
        f"{r['strategy']} (w{r['world_size']}): "
        + (r["note"] if r["max_rel_loss_diff"] is None else f"{r['max_rel_loss_diff']:.2g}")
        for r in compared
        if not r["within_tolerance"]
    ]
    within = _judge(
        "every strategy's losses within tolerance of single's",
        f"max |loss - single's| / single's <= {TOLERANCE:.4g} over every step",
        off, len(compared), not_run,
    )  # fmt: skip
    target = "0 syncs per non-logged step, every strategy at world size 1"
    name = "no host syncs on non-logged steps with AdamW"
    if dry:
        return [within, Goal.unmeasured(name, target)]
    counted = [r for r in rows if isinstance(r["syncs_per_non_logged_step"], float | int)]
    syncing = [f"{r['strategy']}: {r['syncs_per_non_logged_step']:.2g}" for r in counted
               if r["syncs_per_non_logged_step"] > 0]  # fmt: skip
    return [within, _judge(name, target, syncing, len(counted), not_run)]


def result(rows: list[dict], notes: list[str], dry: bool) -> Result:
    cfg = settings(dry)
    where = (
        "CPU, gloo" if dry else "one GPU: NCCL at world size 1, gloo on CUDA tensors for two ranks"
    )
    return Result(
        title="every strategy on NCCL against single, and its host syncs per step",
        shapes=(
            f"gpt2-tiny (moe-tiny for ep), {cfg['steps']} steps of a {cfg['batch']} x "
            f"{cfg['seq_len']}-token global batch (split over the ranks), byte tokenizer, "
            f"AdamW, precision=auto, log_every={cfg['log_every']}; {where}"
        ),
        columns=COLUMNS,
        rows=[{k: v for k, v in r.items() if k != "ran"} for r in rows],
        goals=goals(rows, dry),
        notes=notes,
    )


def world_1_rows(work, corpus, dry, ds_missing, rows, notes) -> dict[str, dict[int, float]]:
    """Single on each model, then every world-size-1 strategy, each a row added to ``rows``
    as it ends; returns single's losses by model."""
    backend = "gloo" if dry else "nccl"
    references: dict[str, dict[int, float]] = {}
    for s in [*REFERENCES.values(), *chosen(WORLD_1, dry)]:
        ref = references.get(s.model, {})
        if s.deepspeed and ds_missing:
            rows.append(row(s, backend, 1, None, ref, ds_missing))
            continue
        try:
            trace = one_rank(overrides(s, work, corpus, 1, dry), count_syncs=not dry)
        except Exception as exc:  # a strategy that fails is a row, not the section's end
            rows.append(
                {**row(s, backend, 1, None, ref, f"failed: {first_line(exc)}"), "ran": True}
            )
            continue
        if s in REFERENCES.values():
            references[s.model] = trace.losses
        r = row(s, backend, 1, trace.losses, references[s.model])
        quiet, logged, synced = sync_counts(trace, dry)
        r.update(syncs_per_non_logged_step=quiet, syncs_per_logged_step=logged)
        if s in REFERENCES.values():
            r.update(max_rel_loss_diff=None, within_tolerance=None, note="the reference")
        if synced:
            notes.append(f"{s.label}: syncs on non-logged {synced}")
        rows.append(r)
        write_partial_rows(result(rows, notes, dry))
    return references


def run(dry: bool) -> Result:
    device(dry)  # refused without a GPU unless dry
    if dry:  # as in the two ranks (nccl_runs.pair_rank), which run beside this process
        torch.set_num_threads(1)
    wanted = chosen(WORLD_1, dry) + chosen(WORLD_2, dry)
    ds_missing = deepspeed_missing() if any(s.deepspeed for s in wanted) else None
    rows: list[dict] = []
    notes = list(NOTES)
    if dry:
        labels = [f"{s.label} (w{w})" for w, group in ((1, WORLD_1), (2, WORLD_2))
                  for s in group if not s.dry]  # fmt: skip
        notes.append(f"dry run: one strategy of each kind; left out {', '.join(labels)}")
    with tempfile.TemporaryDirectory(prefix="nccl-") as tmp:
        work = Path(tmp)
        corpus = small_corpus(work)
        context, out = start_pair(work, corpus, dry, ds_missing)
        references = world_1_rows(work, corpus, dry, ds_missing, rows, notes)
        why = finish_pair(context, deadline(reserve_s=10))
        found = json.loads(out.read_text()) if out.exists() else {}
        pair, pair_notes = pair_rows(found, references, why, ds_missing, dry)
    return result(rows + pair, notes + pair_notes, dry)
