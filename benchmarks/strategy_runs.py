"""One row of benchmarks/strategies.py's tables, run: the strategies and layouts a row can
name, its train.py overrides, its subprocess (timed, its threads set, killed after
--timeout), and what its run directory holds afterwards, beside the ZeRO paper's formulas.
benchmarks/moe_peer.py runs its rows through the same functions."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from llm.parallel.comm_units import comm_phi
from llm.precision import PrecisionPolicy, resolve_precision

REPO = Path(__file__).resolve().parent.parent

# name -> (train.py overrides, ZeRO stage: what is partitioned, 3 = params too)
STRATEGIES = {
    "ddp": (("parallelism=ddp",), 0),
    "zero1": (("parallelism=zero1",), 1),
    "zero2": (("parallelism=zero2",), 2),
    "zero3": (("parallelism=zero3",), 3),
    "fsdp": (("parallelism=fsdp",), 3),  # reshard_after_forward=true: ZeRO-3-like
    "deepspeed1": (("parallelism=deepspeed", "parallelism.zero_stage=1"), 1),
    "deepspeed2": (("parallelism=deepspeed", "parallelism.zero_stage=2"), 2),
    "deepspeed3": (("parallelism=deepspeed", "parallelism.zero_stage=3"), 3),
}
# Elements each rank moves per step, in Φ (paper, section 7): all-reduce = RS + AG = 2Φ;
# stage 3 gathers the parameters twice (forward and backward) besides the reduce-scatter.
PAPER_COMM_PHI = {0: 2, 1: 2, 2: 2, 3: 3}
MB = 1e6


@dataclass(frozen=True)
class Layout:
    """A tensor-, pipeline- or 2-D parallel row: dp x tp x pp and its train.py overrides."""

    dp: int
    tp: int
    pp: int
    overrides: tuple[str, ...]

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp


# Pipeline micro-batches per step: at pp=2 enough for every schedule, 2 stages per rank
# included (1f1b needs >= pp, dualpipev >= 2 x pp, the interleaved ones a multiple of pp).
PP_MICROBATCHES = 4
TP2 = ("parallelism=single", "parallelism.tp_size=2")


def _pp2(schedule: str, virtual_stages: int = 1) -> Layout:
    return Layout(
        1,
        1,
        2,
        (
            "parallelism=single",
            "parallelism.pp_size=2",
            f"parallelism.pp_schedule={schedule}",
            f"parallelism.pp_virtual_stages={virtual_stages}",
            f"parallelism.pp_microbatches={PP_MICROBATCHES}",
        ),
    )


# name -> Layout; the 4-rank 2-D ones are conf/layout's options.
LAYOUTS = {
    "tp2": Layout(1, 2, 1, TP2),
    "tp2_sp": Layout(1, 2, 1, (*TP2, "parallelism.sequence_parallel=true")),
    "pp2_gpipe": _pp2("gpipe"),
    "pp2_1f1b": _pp2("1f1b"),
    "pp2_interleaved_1f1b": _pp2("interleaved_1f1b", 2),
    "pp2_interleaved_zero_bubble": _pp2("interleaved_zero_bubble", 2),
    "pp2_zbv_zero_bubble": _pp2("zbv_zero_bubble", 2),
    "pp2_dualpipev": _pp2("dualpipev", 2),
    "fsdp_dp2_tp2": Layout(2, 2, 1, ("layout=fsdp_dp2_tp2",)),
    "zero1_dp2_tp2": Layout(2, 2, 1, ("layout=zero1_dp2_tp2",)),
    "tp2_pp2": Layout(
        1, 2, 2, ("layout=tp2_pp2", f"parallelism.pp_microbatches={PP_MICROBATCHES}")
    ),
}
DEFAULT_LAYOUTS = "tp2,pp2_1f1b"  # one tensor- and one pipeline-parallel row by default


@dataclass(frozen=True)
class Job:
    strategy: str  # a STRATEGIES or LAYOUTS key, or "single" for the precision rows
    ranks: int
    precision: str

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads global batch / dp sequences per step."""
        return LAYOUTS[self.strategy].dp if self.strategy in LAYOUTS else self.ranks


# ---- the formulas ---------------------------------------------------------------------
def _replica_layout(strategy: str, p: PrecisionPolicy) -> tuple[int, int, int]:
    """Bytes per parameter (params, grads, optimizer states) before any partitioning.

    DDP and FSDP keep param_dtype weights and gradients (autocast only casts the compute);
    our ZeRO and DeepSpeed keep working_dtype ones plus a master copy in the optimizer when
    that differs (mixed precision: the paper's 2 + 2 + 12). AdamW: two moments.
    """
    moments = 2 * p.master_dtype.itemsize  # AdamW's moments follow the weights it updates
    if strategy in ("ddp", "fsdp", "single"):
        return p.param_dtype.itemsize, p.param_dtype.itemsize, moments
    working = p.working_dtype.itemsize
    master = p.master_dtype.itemsize if p.master_dtype != p.working_dtype else 0
    return working, working, master + moments


def formula(strategy: str, p: PrecisionPolicy, n: int, phi: int) -> dict:
    """The paper's bytes per rank for this stage, split by kind, and the expression."""
    stage = STRATEGIES[strategy][1] if strategy in STRATEGIES else 0
    P, G, K = _replica_layout(strategy, p)
    split = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    pairs = list(zip((P, G, K), split, strict=True))
    parts = [b / d for b, d in pairs]
    expr = " + ".join(f"{b}Φ" + ("/N" if d > 1 else "") for b, d in pairs)
    return {
        "params": parts[0] * phi,
        "grads": parts[1] * phi,
        "optimizer_states": parts[2] * phi,
        "total": sum(parts) * phi,
        "expr": expr,
        "phi_per_rank": sum(parts),
    }


def paper_comm_phi(job: Job) -> int | None:
    if job.strategy in LAYOUTS:
        return None  # no ZeRO-paper figure for tensor or pipeline layouts
    if job.ranks == 1 or job.strategy not in STRATEGIES:
        return 0  # nothing to synchronise
    return PAPER_COMM_PHI[STRATEGIES[job.strategy][1]]


def data_parallel_payloads(sent: dict[str, float]) -> dict[str, float]:
    """The data-parallel collectives of a step: tensor- and pipeline-parallel ones are counted
    under a mesh-dimension prefix (``tp.all_reduce``, ``pp.send_activations``) and move
    activations, which the paper's Φ units do not describe."""
    return {kind: payload for kind, payload in sent.items() if "." not in kind}


def parallel_overrides(job: Job) -> tuple[str, ...]:
    if job.strategy in STRATEGIES:
        return STRATEGIES[job.strategy][0]
    if job.strategy in LAYOUTS:
        return LAYOUTS[job.strategy].overrides
    return ("parallelism=single",)


# ---- running one row ------------------------------------------------------------------
def overrides(a: argparse.Namespace, job: Job, run_dir: Path, measure: bool) -> list[str]:
    """The row's train.py overrides. ``measure`` False: the timing pass (no collective
    counting, no peak tracking: both cost step time); True: the measuring pass (counting on,
    the peak tracker on every step, --measure-steps steps)."""
    return [
        *parallel_overrides(job),
        f"launcher.nproc_per_node={job.ranks}",
        f"precision={job.precision}",
        f"model={a.model}",
        f"data={a.data}",
        f"data.tokenizer={a.tokenizer}",
        f"data.seq_len={a.seq_len}",
        f"data.val_samples={a.val_samples}",
        f"train.device={a.device}",
        f"train.micro_batch_size={a.global_batch // job.dp}",
        "train.grad_accum_steps=1",
        f"train.max_steps={a.measure_steps if measure else a.steps}",
        "train.log_every=1",  # every timed step's step_time_s reaches metrics.jsonl
        f"train.eval_every={a.steps}",  # only the (small) final evaluation
        f"parallelism.count_comm={str(measure).lower()}",
        f"train.memory_tracking={'alternate' if measure else 'off'}",
        "scheduler.warmup_steps=1",
        "logger=none",
        "logger.progress=false",
        "checkpoint.enabled=false",
        f"hydra.run.dir={run_dir}",  # output_dir follows; nothing lands in outputs/
        *a.set,
    ]


def one_line_error(log: str) -> str:
    """The line that names the failure: train.py's `error: ...`, else the exception line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    for line in reversed(lines):
        if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]:
            return line
    return lines[-1] if lines else "no output"


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (steal included: another VM's work)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _children_cpu_s() -> float:
    """CPU seconds of our finished children: train.py and, reaped by it, its ranks."""
    t = os.times()
    return t.children_user + t.children_system


def threads_per_rank(a: argparse.Namespace, ranks: int) -> int:
    # One OpenMP pool per rank sized to its share of the cores: oversubscribed pools thrash.
    return a.threads or max(1, (os.cpu_count() or 1) // ranks)


def run_job(a: argparse.Namespace, job: Job, root: Path) -> dict:
    """The timing pass, then the measuring pass (bytes and peaks) of one row."""
    timed = run_pass(a, job, root, measure=False)
    if not timed["ok"]:
        return timed
    measured = run_pass(a, job, root, measure=True)
    if not measured["ok"]:
        return {**timed, "ok": False, "error": f"measuring pass: {measured['error']}"}
    return {**measured, **{k: v for k, v in timed.items() if k in TIMED}}


# What the timing pass contributes to a row; everything else comes from the measuring pass.
TIMED = ("step_times_s", "median_ms", "min_ms", "tokens_per_s", "wall_s", "others_cpu")


def run_timed(cmd: list[str], run_dir: Path, threads: int, timeout: float, row: dict):
    """Run ``cmd`` (its output in run_dir/bench.log) with ``threads`` per rank; records
    ``wall_s``, ``others_cpu`` and ``threads`` in ``row``. Returns its exit code, None when
    it was killed after ``timeout`` seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    busy, ours = _busy_cpu_s(), _children_cpu_s()
    start = time.perf_counter()
    with open(run_dir / "bench.log", "w") as log:
        # Own session: a hung row is killed with every rank it spawned, nothing else.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    row["wall_s"] = time.perf_counter() - start
    # CPU the rest of the machine used meanwhile (cores, on average): a row that shared
    # the cores with another job shows it here, and its timings should be re-taken.
    others = (_busy_cpu_s() - busy) - (_children_cpu_s() - ours)
    row["others_cpu"] = max(0.0, others) / row["wall_s"]
    row["threads"] = threads
    return rc


def run_pass(a: argparse.Namespace, job: Job, root: Path, measure: bool) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    kind = "measure" if measure else "time"
    run_dir = Path(
        tempfile.mkdtemp(prefix=f"{job.strategy}-{job.ranks}-{job.precision}-{kind}-", dir=root)
    )
    row = {"strategy": job.strategy, "ranks": job.ranks, "precision": job.precision}
    row.update(ok=False, error=None, run_dir=str(run_dir))
    if a.device == "cuda" and job.ranks > torch.cuda.device_count():
        row["error"] = f"needs {job.ranks} GPUs, this machine has {torch.cuda.device_count()}"
        return row
    threads = threads_per_rank(a, job.ranks)
    cmd = [sys.executable, str(REPO / "train.py"), *overrides(a, job, run_dir, measure)]
    row["load_at_start"] = os.getloadavg()[0]
    rc = run_timed(cmd, run_dir, threads, a.timeout, row)
    if rc is None:
        row["error"] = f"timed out after {a.timeout} s"
        return row
    if rc != 0:
        row["error"] = one_line_error((run_dir / "bench.log").read_text(errors="replace"))
        return row
    return {**row, **read_run(a, job, run_dir, measure)}


def read_run(a: argparse.Namespace, job: Job, run_dir: Path, measure: bool) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    if not measure:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
        # Probe steps (every other one at log_every=1) carry no time: only timed steps count.
        times = [m["step_time_s"] for m in metrics if m.get("step_time_s") and m["step"] > a.warmup]
        median = statistics.median(times)
        return {
            "ok": True,
            "step_times_s": times,
            "median_ms": median * 1e3,
            "min_ms": min(times) * 1e3,
            "tokens_per_s": a.global_batch * a.seq_len / median,
        }
    phi = summary["n_params"]
    policy = resolve_precision(job.precision, torch.device(a.device))
    sent = summary["comm_bytes_per_step"][0]
    return {
        "ok": True,
        "n_params": phi,
        "model_state_bytes": summary["model_state_bytes"][0],
        "model_state_bytes_per_rank": summary["model_state_bytes"],
        "formula_bytes": None
        if job.strategy in LAYOUTS
        else formula(job.strategy, policy, job.ranks, phi),
        "peak_memory_bytes": summary["peak_memory_bytes"],
        # Rank 0's highest step peak by category, from the one tracker every strategy shares.
        "memory_peak": summary["memory_peak"][0],
        "comm_bytes_per_step": sent,
        "comm_phi": comm_phi(data_parallel_payloads(sent), policy, phi),
        "paper_comm_phi": paper_comm_phi(job),
        "final_train_loss": summary["final_train_loss"],
        "hardware": summary.get("hardware"),
    }


# ---- tables ---------------------------------------------------------------------------


def peak_cells(peak: dict) -> str:
    """A step peak by category in MB (params/grads/optimizer states/activations/other), and
    the phase it fell in: a cell of the strategies table and of the MoE one."""
    kinds = ("params", "grads", "optimizer_states", "activations", "other")
    return "/".join(f"{peak[k] / MB:.2f}" for k in kinds) + f" ({peak['phase']})"


def wait_for_quiet(a: argparse.Namespace) -> None:
    """Between rows nothing of ours runs: wait (up to --quiet-wait s) until the rest of the
    machine uses fewer than --retake-above cores."""
    deadline = time.monotonic() + a.quiet_wait
    while True:
        others = psutil.cpu_percent(interval=3) / 100 * (os.cpu_count() or 1)
        if others <= a.retake_above or time.monotonic() > deadline:
            return


def machine(results: list[dict]) -> str:
    hw = next((r["hardware"] for r in results if r.get("hardware")), None) or {}
    cpu = hw.get("cpu") or platform.processor() or platform.machine()
    gpu = f", {hw['gpu']} x{hw['gpu_count']}" if "gpu" in hw else ""
    out = f"{cpu}, {hw.get('cpu_count', os.cpu_count())} cores{gpu}, torch {torch.__version__}"
    try:
        return f"{out}, DeepSpeed {importlib.metadata.version('deepspeed')}"
    except importlib.metadata.PackageNotFoundError:
        return out
