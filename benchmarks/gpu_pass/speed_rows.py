"""One row of the ``speed`` section, in a fresh process: ours with the fast path on, or
transformers, at one shape, eager or compiled, trained on the shape's shared token file.

Ours: the repository's model (llm.models), bf16 autocast, the attention backend and kernel
``attention=auto`` picks for the device (llm/attention/auto.py), the vocabulary padded to a
multiple of 128 (``model.vocab_multiple``: the head's matmul on tensor-core tiles, the padded
logits -inf), torch's fused AdamW, and the loss by compile setting: eager, the fused linear
cross-entropy (llm/train/loss.py, ``train.fused_loss``) called by the model as its head, as
the trainer calls it; compiled, the plain loss (``train.fused_loss=off``), compiled too (as
the trainer compiles it under ``train.compile``): Inductor fuses the fp32 upcast into the
log-sum-exp, while the fused losses' Triton kernels would stay outside the compiled graph.
Transformers: GPT2LMHeadModel or LlamaForCausalLM at the same shape (llm.models.hf_config),
sdpa attention, the same autocast and AdamW, the fp32 cross-entropy of its logits, compiled
with the model in a compiled row (as its own loss is when labels go through a compiled
model). The records of 2026-11-28 (commits 54fb69b, d11afb6) ran that loss eagerly.

Step ``i`` trains on batch ``i`` of the token file. Timed steps are bracketed by device
syncs and nothing else; the loss is read after them (the loss of the last step, mean per
token, from its forward); then one more step, untimed, runs under torch.profiler for the top
kernels.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.timing import sync
from llm.attention.auto import Device, resolve
from llm.memory import cuda_peak_bytes, reset_cuda_peak
from llm.models import ModelArgs, build_model, materialize
from llm.models.hf_config import hf_config
from llm.train.loss import head_loss, unavailable

FUSED_LOSSES = ("liger", "cce")  # in order of preference; chunked where neither runs
VOCAB_MULTIPLE = 128  # model.vocab_multiple for ours
LOSS_CHUNK = 1024  # train.fused_loss_chunk's default (llm/config/train.py)
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
TOP_KERNELS = 3
NAME_CHARS = 72


@dataclass(frozen=True)
class Row:
    impl: str  # ours | transformers
    compile: bool
    device: str  # cuda | cpu
    args: ModelArgs
    batch: int
    seq_len: int
    steps: int  # timed
    warmup: int
    tokens_path: str  # (warmup + steps) * batch * (seq_len + 1) int64 ids, .npy


def write_tokens(path: str, vocab_size: int, batches: int, batch: int, seq_len: int) -> None:
    """The token ids every row of a shape trains on: seeded, so every call writes the same."""
    ids = np.random.default_rng(0).integers(0, vocab_size, batches * batch * (seq_len + 1))
    np.save(path, ids.astype(np.int64))


def fused_loss(device: torch.device) -> tuple[str, str]:
    """The fused loss ours runs with on ``device`` and why: liger, else cce, else chunked."""
    refusals = []
    for name in FUSED_LOSSES:
        why = unavailable(name, device)
        if why is None:
            return name, f"fused loss {name}: imports and runs on {device.type}"
        refusals.append(why)
    return "chunked", "fused loss chunked (plain torch): " + "; ".join(refusals)


def attention_pick(args: ModelArgs, device: torch.device, seq_len: int):
    """attention=auto's backend, sdpa kernel and reason, for bf16 causal attention."""
    return resolve(
        "auto",
        "auto",
        device=Device.of(device),
        dtype=torch.bfloat16,
        head_dim=args.head_dim,
        seq_len=seq_len,
        document_mask=False,
        gqa=args.n_kv_heads != args.n_heads,
        dropout=args.dropout > 0,
    )


def _short(name: str) -> str:
    """A kernel name fit for a table cell: no pipes, no leading ``void``, at most NAME_CHARS
    characters."""
    name = name.replace("|", "/").strip().removeprefix("void ")
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


def top_kernels(prof: profile, on_gpu: bool, n: int = TOP_KERNELS) -> list[str]:
    """The ``n`` kernels (GPU) or ops (CPU, self time) that took the most time in the
    profiled step, each with its share of that step's kernel (op) time."""
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if on_gpu and e.device_type == DeviceType.CUDA:
            by_name[e.name] += e.time_range.elapsed_us()
        elif not on_gpu and e.device_type == DeviceType.CPU and "::" in e.name:
            by_name[e.name] += e.self_cpu_time_total
    total = sum(by_name.values()) or 1.0
    ranked = sorted(by_name.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return [f"{_short(name)} ({us / total:.0%})" for name, us in ranked]


def _build(row: Row, dev: torch.device) -> tuple[torch.nn.Module, dict]:
    """The model, and what the row's table cells say of its attention and loss."""
    if row.impl == "ours":
        choice = attention_pick(row.args, dev, row.seq_len)
        args = row.args.padded(VOCAB_MULTIPLE)
        model = materialize(build_model(args, choice.backend, choice.kernel), dev, seed=0)
        loss, loss_why = (
            ("off", "compiled: the plain loss, compiled") if row.compile else fused_loss(dev)
        )
        attention = choice.backend + ("" if choice.kernel == "auto" else f":{choice.kernel}")
        return model, {"attention": attention, "loss": loss, "why": [choice.why, loss_why]}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(row.args), attn_implementation="sdpa")
    return model.to(dev), {"attention": "sdpa", "loss": "fp32 logits", "why": []}


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of (B, T, V) logits, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run_row(row: Row) -> dict:
    """Build, warm up, time, read the loss, profile one more step; runs in its own process."""
    dev = torch.device(row.device)
    torch.manual_seed(0)
    reset_cuda_peak(dev)
    model, picks = _build(row, dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=dev.type == "cuda")
    step_model = torch.compile(model) if row.compile else model
    plain_loss = torch.compile(_mean_cross_entropy) if row.compile else _mean_cross_entropy
    shape = (row.warmup + row.steps, row.batch, row.seq_len + 1)
    data = torch.from_numpy(np.load(row.tokens_path).reshape(shape)).to(dev)
    tokens = row.batch * row.seq_len

    def step(i: int) -> torch.Tensor:
        inputs, targets = data[i, :, :-1], data[i, :, 1:]  # (B, T) each
        with torch.autocast(dev.type, torch.bfloat16):
            if row.impl == "ours" and picks["loss"] != "off":
                head = head_loss(picks["loss"], targets, LOSS_CHUNK)
                loss = step_model(inputs, head=head) / tokens  # the head returns the sum
            else:
                extra = {} if row.impl == "ours" else {"use_cache": False}
                out = step_model(inputs, **extra)
                logits = out if row.impl == "ours" else out.logits  # (B, T, V)
                loss = plain_loss(logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(row.warmup):
        step(i)
    times, last = [], None
    for i in range(row.warmup, row.warmup + row.steps):
        sync(dev)
        start = time.perf_counter()
        last = step(i)
        sync(dev)
        times.append(time.perf_counter() - start)
    peak = cuda_peak_bytes(dev)
    loss = last.item()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(row.warmup + row.steps - 1)
        sync(dev)
    return {
        "tokens_per_s": tokens / statistics.median(times),
        "peak_alloc_bytes": peak,
        "loss": loss,
        "top_kernels": top_kernels(prof, dev.type == "cuda"),
        "attention": picks["attention"],
        "fused_loss": picks["loss"],
        "why": picks["why"],
    }


def in_fresh_process(row: Row) -> dict:
    """``run_row`` in a spawned process of its own, so its allocator peak is its own."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(run_row, row).result()
