"""Our ZeRO's offload tiers at gpt2-large on 2 CPU ranks: memory per rank, disk traffic per
step and step time, in memory, with the optimizer offloaded to CPU memory, and to NVMe files,
beside DeepSpeed's own NVMe offload (docs/zero.md, "The NVMe tier").

Each row spawns 2 gloo ranks that build the model on the meta device, wrap it with the
row's strategy (each rank materialising only its part), and train ``--steps`` steps of
random tokens (fp32, AdamW); the last step is measured. Per rank:

- RSS after the step, anonymous and file-backed apart (/proc/self/status RssAnon, RssFile;
  after glibc's ``malloc_trim``, so the heap's freed temporaries do not count), and the peak
  RSS of the run (VmHWM, which does count them);
- bytes read and written by the step, as the kernel counts them for the process
  (/proc/self/io read_bytes, write_bytes: what reached the storage layer; O_DIRECT I/O
  counts, page-cache hits do not) and as the nvme tier counts them itself, against the
  formula: 12Φ/N each way for AdamW's master and two moments in fp32;
- the step's time and its optimizer step's (clip_and_step) alone.

The default rows are zero3: in memory, with the optimizer offloaded to CPU memory (on a CPU
device the master and moments are in that memory already, so it equals the first), to
nvme, and with the parameter shards on nvme too; then DeepSpeed's ZeRO-3 with its optimizer
on nvme, and with its parameters there too (its async_io op swaps them with libaio: `make
libaio` installs it, `make bench-nvme` runs this with it; the op and its CPU Adam are
JIT-built into TORCH_EXTENSIONS_DIR on first use). The ``-lean`` DeepSpeed rows run the
same with examples/ds_config_nvme.json, DeepSpeed's memory knobs for NVMe (``LEAN_DS_CONFIG``).
DeepSpeed's rows need far more memory than ours: its engine materialises and partitions
the whole model on each rank, and at gpt2-large each of its 2 ranks passed 12 GiB (docs/zero.md).
The machine is shared, so check `free -g`
first: gpt2-large in memory needs about 7 GiB per rank under zero3 (fp32: the shard, its
gradient and two moments, 16Φ/N, plus the gathered blocks), 9 under zero2.
``--model gpt2-medium`` is the fallback.

    python benchmarks/nvme_offload.py --nvme-path /tmp/nvme
    python benchmarks/nvme_offload.py --model gpt2-medium --rows zero2,zero2-nvme
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llm.config import Config, OptimizerConfig, ParallelismConfig, TrainConfig
from llm.launch.launcher import free_port, set_cache_dirs
from llm.models import InitSource, build_model, model_args
from llm.parallel import ParallelDims, build_strategy
from llm.precision import resolve_precision

CPU = torch.device("cpu")
WORLD = 2
MiB = 2**20
# DeepSpeed's memory knobs for NVMe: optimizer sub-groups of 1e8 elements (1e9 by
# default); max_in_cpu 0, so that its parameters go to the disk as ours do (by default it
# keeps up to 1e9 elements in CPU memory); and, for that, 16 parameter swap buffers of 3.3e7
# elements, at most 1e8 live parameter elements and a reuse distance of 0, so that a
# parameter's buffer is freed after its use: with its defaults every buffer stayed taken and
# the next swap-in failed ("Not enough buffers 0 for swapping 1", DeepSpeed issue #3062).
LEAN_DS_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "ds_config_nvme.json"
# name: (strategy, offload_optimizer, offload_params); deepspeed rows run its ZeRO-3, the
# "-lean" ones with LEAN_DS_CONFIG
ROWS = {
    "zero3": ("zero3", "none", "none"),
    "zero3-cpu": ("zero3", "cpu", "none"),
    "zero3-nvme": ("zero3", "nvme", "none"),
    "zero3-nvme-params": ("zero3", "nvme", "nvme"),
    "zero2": ("zero2", "none", "none"),
    "zero2-nvme": ("zero2", "nvme", "none"),
    "ds-zero3-nvme": ("deepspeed", "nvme", "none"),
    "ds-zero3-nvme-params": ("deepspeed", "nvme", "nvme"),
    "ds-zero3-nvme-lean": ("deepspeed", "nvme", "none"),
    "ds-zero3-nvme-params-lean": ("deepspeed", "nvme", "nvme"),
}
DEFAULT_ROWS = "zero3,zero3-cpu,zero3-nvme,zero3-nvme-params,ds-zero3-nvme,ds-zero3-nvme-params"


def _trim() -> None:
    """Hand the heap's free pages back (glibc's malloc_trim): bucket-sized temporaries freed
    at start-up otherwise stay in the process's RSS, and would be counted as held."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _io() -> dict[str, int]:
    pairs = (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(v) for k, v in pairs if k in ("read_bytes", "write_bytes")}


def _swapped(strategy) -> tuple[int, int]:
    facts = strategy.offload_facts() or {}
    parts = [facts[k] for k in ("optimizer", "params") if k in facts]
    return sum(p["read_bytes"] for p in parts), sum(p["written_bytes"] for p in parts)


def _rank(rank, world, port, results, args, row, nvme_path) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # What a launcher sets: DeepSpeed's engine refuses to start without LOCAL_RANK.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    name, optimizer, params = ROWS[row]
    cfg = ParallelismConfig(
        name=name,
        zero_stage=3 if name == "deepspeed" else 0,
        offload_optimizer=optimizer,
        offload_params=params,
        nvme_path=nvme_path if "nvme" in (optimizer, params) else None,
        deepspeed_config=str(LEAN_DS_CONFIG) if row.endswith("-lean") else None,
    )
    # DeepSpeed builds its engine from the whole run's settings: one sequence per rank and
    # step, clipping at 1.0, as the loop below does for ours.
    run_config = Config(
        parallelism=cfg,
        optimizer=OptimizerConfig(lr=1e-4),
        train=TrainConfig(micro_batch_size=1, grad_clip=1.0, device="cpu"),
    )
    margs = model_args(args.model)
    strategy = build_strategy(
        cfg,
        ParallelDims.from_config(-1, 1, 1, world, rank),
        resolve_precision("fp32", CPU),
        CPU,
        run_config=run_config,
    )
    try:
        model = strategy.wrap(build_model(margs), InitSource(margs, 0))
        strategy.build_optimizer(model, run_config.optimizer)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            tokens = torch.randint(0, margs.vocab_size, (1, args.seq + 1), generator=gen)
            io, swapped, start = _io(), _swapped(strategy), time.perf_counter()
            with strategy.micro_batch(sync=True):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                strategy.backward(loss)
            stepped = time.perf_counter()
            strategy.clip_and_step(max_norm=1.0)
            strategy.zero_grad()
            end = time.perf_counter()
            _trim()
        after, swapped_after = _io(), _swapped(strategy)
        # DeepSpeed's stage-3 parameters hold their partition only; ds_numel is the whole.
        phi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        results[rank] = {
            **_status(),
            "read": after["read_bytes"] - io["read_bytes"],
            "written": after["write_bytes"] - io["write_bytes"],
            "swap_read": swapped_after[0] - swapped[0],
            "swap_written": swapped_after[1] - swapped[1],
            "step_s": end - start,
            "optimizer_s": end - stepped,
            "phi": phi,
            # DeepSpeed's async_io op opens its swap files with O_DIRECT, always.
            "io": "libaio, O_DIRECT"
            if name == "deepspeed"
            else (strategy.offload_facts() or {}).get("optimizer", {}).get("io", "-"),
        }
    finally:
        strategy.close()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"of {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--nvme-path", default=None, help="default: a temporary folder")
    args = parser.parse_args()
    set_cache_dirs()  # DeepSpeed's JIT-built ops are found in, or go to, .cache/torch_extensions
    nvme = Path(args.nvme_path or tempfile.mkdtemp(prefix="nvme-bench-"))
    nvme.mkdir(parents=True, exist_ok=True)
    header = (
        "row", "RssAnon MiB", "RssFile MiB", "VmHWM MiB", "read MiB", "written MiB",
        "ours r/w MiB", "12Φ/N MiB", "step s", "optimizer s", "io",
    )  # fmt: skip
    print(f"{args.model}, {WORLD} CPU ranks, fp32, AdamW; rank 0 (rank 1 within a few MiB)")
    print(" | ".join(header))
    try:
        for row in args.rows.split(","):
            results = mp.Manager().dict()
            mp.start_processes(
                _rank,
                args=(WORLD, free_port(), results, args, row, str(nvme)),
                nprocs=WORLD,
                start_method="spawn",
            )
            r = results[0]
            formula = 12 * r["phi"] / WORLD / MiB
            cells = (
                row,
                f"{r['RssAnon'] / MiB:,.0f}",
                f"{r['RssFile'] / MiB:,.0f}",
                f"{r['VmHWM'] / MiB:,.0f}",
                f"{r['read'] / MiB:,.0f}",
                f"{r['written'] / MiB:,.0f}",
                f"{r['swap_read'] / MiB:,.0f} / {r['swap_written'] / MiB:,.0f}"
                if ROWS[row][0] != "deepspeed"
                else "-",
                f"{formula:,.0f}",
                f"{r['step_s']:.2f}",
                f"{r['optimizer_s']:.2f}",
                r["io"],
            )
            print(" | ".join(cells), flush=True)
    finally:
        if args.nvme_path is None:
            shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
