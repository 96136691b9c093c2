"""Checkpoint temporaries of every strategy and layout: a save and a resume, measured by the
peak tracker.

Each row trains 2 steps and saves (checkpoint.every=0: the save at the end), then resumes
from that checkpoint for a third step, as tests/test_checkpoint_memory.py does, on CPU ranks
over gloo in bf16. From the runs' summary.json, per rank: the peak tracker's "other" bytes
(the temporaries: everything live that is not params, grads, optimizer states or
activations, llm/memory/peak.py) at its highest in the checkpoint_save phase of the first
run and the checkpoint_load phase of the second, and the rank's own model state
(``strategy.memory()``: params + grads + optimizer states on that rank). The bound is the
test's: one bucket in fp32 (4 bytes x max(bucket_cap_mb / working bytes, the largest
parameter)) for a load, plus one checkpoint file (max(checkpoint.file_mb, that bucket)) for a
save, plus 256 KiB of DCP plans, metadata and RNG states. A rank that gathers, or makes a
whole extra copy of its state, shows as a multiple of the bucket once the model's state per
rank is several buckets (gpt2-small, the default: 86M parameters with the byte tokenizer,
0.7-1.4 GB of state per rank on 2 ranks against a 50 MiB bucket). The peak tracker counts as
"other" whatever a strategy's state_tensors() does not name at that moment, so a buffer
held all run but not listed then (DDP's gradient buckets while no .grad exists) shows here
too: docs/zero.md ("Checkpoint temporaries") explains the rows over their bounds.

When a row cannot resume its own checkpoint (pp=2 at the time of writing: docs/zero.md),
its load is measured resuming the same layout from a one-process checkpoint instead, marked
with a dagger and the error. The default rows take about 9 minutes on 2 CPU cores.

Rows: single (1 rank), ddp, zero1-3, fsdp and deepspeed stages 1-3 (2 ranks), tp2 and pp2
(2 ranks, parallelism=single), and with --rows the 4-rank conf/layout options. Every row runs
in this process through llm.launch.launcher.launch (ranks spawned as train.py spawns them), with
OMP_NUM_THREADS = cores // ranks; a row that fails shows its one-line error and the next
one runs. The corpus is a folder of standard-library modules made in a temporary folder.

    python benchmarks/checkpoint_memory.py                       # every default row
    python benchmarks/checkpoint_memory.py --rows zero3,fsdp     # some rows
    python benchmarks/checkpoint_memory.py --rows all            # + 4-rank layouts
    python benchmarks/checkpoint_memory.py --model gpt2-mini --set parallelism.bucket_cap_mb=1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from llm.build import model_args_for, tokenizer_vocab_size
from llm.config import Config, register_configs, to_dataclass
from llm.launch.launcher import launch
from llm.parallel.tensor_parallel import padded_vocab
from llm.validate import validate

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
MiB = 2**20
SLACK = 256 * 1024  # DCP's plans and metadata, RNG states, pickled objects (as the test)
WORKING_BYTES = 2  # bf16: the working dtype the bucket sizes are counted in
STDLIB_FILES = (
    "textwrap.py",
    "shlex.py",
    "fnmatch.py",
    "glob.py",
    "bisect.py",
    "heapq.py",
    "colorsys.py",
    "keyword.py",
    "stat.py",
    "this.py",
    "base64.py",
    "string.py",
    "copy.py",
    "queue.py",
    "sched.py",
    "numbers.py",
    "operator.py",
    "linecache.py",
)


@dataclass(frozen=True)
class Row:
    ranks: int
    overrides: tuple[str, ...]


# pp rows: 2 micro-batches of 1 sequence each (the schedule splits the loader batch).
PP_BATCH = ("train.micro_batch_size=2",)
ROWS = {
    "single": Row(1, ("parallelism=single",)),
    "ddp": Row(2, ("parallelism=ddp",)),
    "zero1": Row(2, ("parallelism=zero1",)),
    "zero2": Row(2, ("parallelism=zero2",)),
    "zero3": Row(2, ("parallelism=zero3",)),
    "fsdp": Row(2, ("parallelism=fsdp",)),
    "deepspeed1": Row(2, ("parallelism=deepspeed", "parallelism.zero_stage=1")),
    "deepspeed2": Row(2, ("parallelism=deepspeed", "parallelism.zero_stage=2")),
    "deepspeed3": Row(2, ("parallelism=deepspeed", "parallelism.zero_stage=3")),
    "tp2": Row(2, ("parallelism=single", "parallelism.tp_size=2")),
    "pp2": Row(2, ("parallelism=single", "parallelism.pp_size=2", *PP_BATCH)),
    # 4-rank layouts (conf/layout), with --rows all or by name
    "tp2_pp2": Row(4, ("layout=tp2_pp2", *PP_BATCH)),
    "fsdp_dp2_tp2": Row(4, ("layout=fsdp_dp2_tp2",)),
    "zero1_dp2_tp2": Row(4, ("layout=zero1_dp2_tp2",)),
    "zero2_dp2_pp2": Row(4, ("layout=zero2_dp2_pp2", *PP_BATCH)),
}
DEFAULT_ROWS = [name for name, row in ROWS.items() if row.ranks <= 2]


def compose_config(overrides: list[str]) -> Config:
    """The config train.py would build from these overrides."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return to_dataclass(cfg)


def make_corpus(root: Path) -> Path:
    """A folder of real text documents of different lengths (standard-library modules)."""
    root.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        (root / f"{Path(name).stem}.txt").write_text((stdlib / name).read_text())
    return root


def run_overrides(a: argparse.Namespace, out: Path, corpus: Path, cache: Path) -> list[str]:
    """A small CPU run on the corpus: byte tokenizer, bf16, no W&B, no mid-run evaluation."""
    return [
        f"output_dir={out}",
        f"model={a.model}",
        "data=files",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "data.tokenizer=byte",
        f"data.seq_len={a.seq_len}",
        "data.val_samples=4",
        "train.device=cpu",
        "train.micro_batch_size=1",
        "train.log_every=1",
        "train.eval_every=1000",
        "scheduler.warmup_steps=1",
        "precision=bf16",
        "logger=none",
        "logger.progress=false",
    ]


def launch_run(overrides: list[str]) -> dict:
    cfg = compose_config(overrides)
    validate(cfg)
    return launch(cfg)


def largest_param(ckpt: Path) -> int:
    """Elements of the largest model tensor in the checkpoint (whole shapes)."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    return max(
        math.prod(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")
    )


def bounds(cfg: Config, ckpt: Path) -> tuple[int, int]:
    """(save bound, load bound) in bytes, as tests/test_checkpoint_memory.py computes them."""
    bucket_mb = cfg.parallelism.bucket_cap_mb  # fsdp and single have none: the 25 MB default
    bucket = 4 * max(int(bucket_mb * MiB / WORKING_BYTES), largest_param(ckpt))
    one_file = max(int(cfg.checkpoint.file_mb * MiB), bucket)
    return one_file + bucket + SLACK, bucket + SLACK


def _one_line(exc: BaseException) -> str:
    """The error's first line, without the rank's traceback file (removed with the row)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return first.split(" (traceback: ")[0]


def _threads(ranks: int) -> None:
    """OMP threads per rank: the cores shared out (oversubscribed pools thrash)."""
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))


def _save(a, out: Path, corpus: Path, cache: Path, common: list[str]) -> tuple[dict, Path]:
    """Train 2 steps and save: (summary, checkpoint)."""
    summary = launch_run([*run_overrides(a, out, corpus, cache), *common, "train.max_steps=2"])
    return summary, sorted((out / "checkpoints").glob("step_*"))[-1]


def _resume(a, out: Path, corpus: Path, cache: Path, common: list[str], ckpt: Path) -> dict:
    """Resume from ``ckpt`` for a third step: the summary."""
    extra = ["train.max_steps=3", f"checkpoint.resume={ckpt}"]
    return launch_run([*run_overrides(a, out, corpus, cache), *common, *extra])


def measure(a: argparse.Namespace, name: str, root: Path, corpus: Path, cache: Path) -> dict:
    """Save after 2 steps, resume for a third; the row's figures. When the resume fails
    (pp=2: see docs/zero.md), the error is kept and the load is measured again resuming the
    same layout from a one-process checkpoint of the same model."""
    row = ROWS[name]
    here = root / name
    common = [f"launcher.nproc_per_node={row.ranks}", *row.overrides, *a.set]
    started = time.perf_counter()
    _threads(row.ranks)
    saved, ckpt = _save(a, here / "saved", corpus, cache, common)
    cfg = compose_config([*run_overrides(a, here / "saved", corpus, cache), *common])
    save_bound, load_bound = bounds(cfg, ckpt)
    result = {
        "row": name,
        "ranks": row.ranks,
        "n_params": saved["n_params"],
        "state_bytes": [sum(m.values()) for m in saved["model_state_bytes"]],
        "save_other": [p["checkpoint_save"]["other"] for p in saved["memory_peak_by_phase"]],
        "save_bound": save_bound,
        "load_bound": load_bound,
    }
    try:
        resumed = _resume(a, here / "resumed", corpus, cache, common, ckpt)
    except Exception as exc:
        result["resume_error"] = _one_line(exc)
        batch = [o for o in row.overrides if o.startswith("train.")]
        # The model's shape as the layout builds it (tensor parallel pads the vocabulary).
        vocab = padded_vocab(
            model_args_for(cfg, tokenizer_vocab_size(cfg)).vocab_size, cfg.parallelism.tp_size
        )
        one = ["launcher.nproc_per_node=1", "parallelism=single", f"model.vocab_size={vocab}"]
        one += [*batch, *a.set]
        _threads(1)
        _, one_ckpt = _save(a, here / "one_process", corpus, cache, one)
        _threads(row.ranks)
        resumed = _resume(a, here / "resumed_from_one", corpus, cache, common, one_ckpt)
    result["load_other"] = [p["checkpoint_load"]["other"] for p in resumed["memory_peak_by_phase"]]
    result["save_ok"] = max(result["save_other"]) <= save_bound
    result["load_ok"] = max(result["load_other"]) <= load_bound
    result["wall_s"] = time.perf_counter() - started
    if not a.keep:
        shutil.rmtree(here, ignore_errors=True)  # a checkpoint per run: GBs
    return result


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def _params(n: int) -> str:
    return f"{n / 1e6:.1f}M"


def table(results: list[dict]) -> str:
    head = (
        "| strategy / layout | ranks | Φ | own state (max rank), MiB | save other (max rank), MiB "
        "| load other (max rank), MiB | bound save / load, MiB | save | load |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['ranks']} | | | | | | failed: {r['error']} | |")
            continue
        ok = {True: "within", False: "**exceeds**"}
        mark = "†" if "resume_error" in r else ""
        lines.append(
            f"| {r['row']} | {r['ranks']} | {_params(r['n_params'])} "
            f"| {_mib(max(r['state_bytes']))} | {_mib(max(r['save_other']))} "
            f"| {_mib(max(r['load_other']))}{mark} "
            f"| {_mib(r['save_bound'])} / {_mib(r['load_bound'])} "
            f"| {ok[r['save_ok']]} | {ok[r['load_ok']]} |"
        )
    for r in results:
        if "resume_error" in r:
            lines.append(
                f"\n† {r['row']}: resuming its own checkpoint failed ({r['resume_error']}); "
                "its load is measured resuming the same layout from a one-process checkpoint."
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated, or 'all' (default: {','.join(DEFAULT_ROWS)}; "
        f"also: {','.join(n for n in ROWS if n not in DEFAULT_ROWS)})",
    )
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument(
        "--set", action="append", default=[], help="a train.py override for every run"
    )
    parser.add_argument("--json", type=Path, help="also write the per-rank figures here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    a = parser.parse_args()
    names = list(ROWS) if a.rows == "all" else a.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")

    root = Path(tempfile.mkdtemp(prefix="checkpoint_memory_"))
    corpus, cache = make_corpus(root / "corpus"), root / "cache"
    results = []
    started = time.perf_counter()
    try:
        for name in names:
            try:
                result = measure(a, name, root, corpus, cache)
            except Exception as exc:  # a failed row is shown as failed; the next one runs
                result = {"row": name, "ranks": ROWS[name].ranks, "error": _one_line(exc)}
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"runs kept in {root}")
    print()
    print(
        f"model={a.model} byte tokenizer, seq {a.seq_len}, micro batch 1, bf16, CPU + gloo, "
        f"torch {torch.__version__}; {time.perf_counter() - started:.0f} s"
    )
    print()
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
