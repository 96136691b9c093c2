"""Attention kernels, forward and forward+backward TFLOP/s, each checked against an fp32
reference: our Triton kernel against SDPA's flash, efficient and cuDNN kernels, flex,
eager, and flash_attn and xformers where they import.

Shapes follow the FlashAttention-2 paper: B·T = 16k tokens, H = 2048 / D heads, causal, head
dims 128 and 64, T from 1k to 16k, with and without a document mask (packed documents of
256 to 2048 tokens, drawn once with a fixed seed). FLOPs count the (query, key) pairs the
mask allows, 4·B·H·D per pair forward and 3.5 times that forward+backward (the papers'
convention: causal is T²/2 pairs). Accuracy, on B=1, H=4, T=1024 (64 in the dry run): the
largest error of the output and of each gradient against the same attention in fp32,
passing where it is at most twice that of torch's own fused kernel plus 1e-5
(the FlashAttention repository's criterion; its flash kernel, or its efficient kernel
where a document mask is needed, as flash takes none).
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_pass.common import (
    Goal,
    Result,
    deadline,
    device,
    earlier_rows,
    write_partial_rows,
)
from benchmarks.timing import median_ms
from llm.attention import Documents, attention, check_kernel
from llm.errors import ConfigError

GPU = {
    "backends": ["triton", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "flex", "eager",
                 "flash_attn", "xformers"],
    "head_dims": [128, 64], "seq_lens": [1024, 2048, 4096, 8192, 16384], "tokens": 16384,
    "width": 2048, "dtype": torch.bfloat16, "eager_max_t": 4096, "check_t": 1024,
    "min_run_time": 0.1,
}  # fmt: skip
DRY = {
    "backends": ["triton", "sdpa", "flex", "eager", "flash_attn", "xformers"],
    "head_dims": [16], "seq_lens": [64, 128], "tokens": 256, "width": 64,
    "dtype": torch.float32, "eager_max_t": 128, "check_t": 64, "min_run_time": 0.01,
}  # fmt: skip
FACTOR, FLOOR = 2.0, 1e-5


def _split(name: str) -> tuple[str, str]:
    backend, _, kernel = name.partition(":")
    return backend, kernel or "auto"


def doc_ids(batch: int, t: int, dev) -> torch.Tensor:
    """(B, T) ids of packed documents of 256 to 2048 tokens (shorter when T is), one draw."""
    g = torch.Generator().manual_seed(0)
    lo, hi = min(256, t // 4), min(2048, t // 2)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < t:
            lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
            total += lengths[-1]
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows.append(ids[:t])
    return torch.stack(rows).to(dev)


def allowed_pairs(ids: torch.Tensor | None, batch: int, t: int) -> float:
    """(query, key) pairs a causal mask allows, summed over the batch: T²/2 per row without
    documents (the papers' convention), L²/2 per document of length L with them."""
    if ids is None:
        return batch * t * t / 2
    lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in ids])
    return float((lengths.double() ** 2).sum() / 2)


def reference(q, k, v, ids) -> torch.Tensor:
    """softmax(q kᵀ / √D + mask) v in fp32, the mask spelled out (causal, same document)."""
    rep = q.size(1) // k.size(1)
    k, v = (x.float().repeat_interleave(rep, dim=1) for x in (k, v))
    t = q.size(2)
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril().expand(q.size(0), 1, t, t)
    if ids is not None:
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    scores = (q.float() @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v  # (B, H, T, D)


def _inputs(b, h, t, d, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g, device=dev, dtype=dtype) for _ in "qkvo")
    return [x.requires_grad_() for x in (q, k, v)], dout


def _out_grads(fn, q, k, v, dout):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def fresh_compile(name: str) -> None:
    """Flex compiles once per shape, and past dynamo's recompile limit (8) falls back to its
    unfused path: the sweep's 20-odd shapes would time that path, not flex's kernel."""
    if name == "flex":
        torch._dynamo.reset()


def max_errors(name: str, d: int, docs: bool, s: dict, dev) -> list[float]:
    """Largest |error| of out, dq, dk, dv against the fp32 reference on the same inputs."""
    fresh_compile(name)
    t = s["check_t"]
    (q, k, v), dout = _inputs(1, 4, t, d, s["dtype"], dev, seed=1)
    ids = doc_ids(1, t, dev) if docs else None
    backend, kernel = _split(name)
    wrap = Documents(ids) if docs else None

    def ours(q, k, v):
        return attention(q, k, v, causal=True, backend=backend, kernel=kernel, docs=wrap)

    got = _out_grads(ours, q, k, v, dout)
    want = _out_grads(lambda q, k, v: reference(q, k, v, ids), q, k, v, dout.float())
    return [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True)]


def measure(name: str, d: int, t: int, docs: bool, s: dict, dev) -> dict:
    fresh_compile(name)
    b, h = max(s["tokens"] // t, 1), s["width"] // d
    (q, k, v), dout = _inputs(b, h, t, d, s["dtype"], dev)
    ids = doc_ids(b, t, dev) if docs else None
    backend, kernel = _split(name)
    wrap = Documents(ids) if docs else None

    def fwd():
        return attention(q, k, v, causal=True, backend=backend, kernel=kernel, docs=wrap)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dout)

    with torch.no_grad():
        fwd_ms = median_ms(fwd, warmup=2, min_run_time=s["min_run_time"])
    both_ms = median_ms(fwd_bwd, warmup=2, min_run_time=s["min_run_time"])
    flops = 4 * h * d * allowed_pairs(ids, b, t)
    return {
        "backend": name, "head_dim": d, "seq_len": t, "batch": b, "docs": docs,
        "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
        "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * flops / both_ms / 1e9,
    }  # fmt: skip


def refusal(name: str, d: int, docs: bool, s: dict, dev) -> str | None:
    """Why this kernel cannot train this here (check_kernel's one line), or None."""
    backend, kernel = _split(name)
    try:
        check_kernel(
            backend, kernel, device=dev.type, dtype=s["dtype"], head_dim=d, gqa=False,
            dropout=False, document_mask=docs, training=True,
        )  # fmt: skip
    except ConfigError as e:
        return str(e)
    return None


class Accuracy:
    """Each kernel's errors against the fp32 reference, computed on first use, and whether
    they pass against torch's fused kernel's on the same inputs."""

    def __init__(self, s: dict, dev) -> None:
        self.s, self.dev, self.done = s, dev, {}

    def _errors(self, name: str, d: int, docs: bool) -> list[float]:
        if (name, d, docs) not in self.done:
            self.done[name, d, docs] = max_errors(name, d, docs, self.s, self.dev)
        return self.done[name, d, docs]

    def of(self, name: str, d: int, docs: bool) -> dict:
        base = "sdpa" if self.dev.type == "cpu" else ("sdpa:efficient" if docs else "sdpa:flash")
        err, base_err = self._errors(name, d, docs), self._errors(base, d, docs)
        ok = all(e <= FACTOR * be + FLOOR for e, be in zip(err, base_err, strict=True))
        return {"max_err_out": err[0], "max_err_grad": max(err[1:]), "accurate": ok}


GOAL_PAIR = ("triton", "sdpa:flash")


def plan(s: dict) -> list[tuple[str, int, bool, int]]:
    """(kernel, D, documents, T) in the order they run, so a section cut short keeps what
    matters most: the goal's pair without documents, then every kernel with documents,
    then the other kernels without."""
    names, dims, seqs = s["backends"], s["head_dims"], s["seq_lens"]
    pair = [(n, d, False, t) for d in dims for t in seqs for n in names if n in GOAL_PAIR]
    docs = [(n, d, True, t) for d in dims for t in seqs for n in names]
    rest = [(n, d, False, t) for d in dims for t in seqs for n in names if n not in GOAL_PAIR]
    return [p for p in pair + docs + rest if p[0] != "eager" or p[3] <= s["eager_max_t"]]


def _speed_goals(rows: list[dict], s: dict, dry: bool) -> list[Goal]:
    goals = []
    for d in s["head_dims"]:
        for metric in ("fwd_tflops", "fwd_bwd_tflops"):
            pairs = []
            for t in (t for t in s["seq_lens"] if t >= 2048 or dry):
                got = {r["backend"]: r[metric] for r in rows
                       if (r["head_dim"], r["seq_len"], r["docs"]) == (d, t, False)}  # fmt: skip
                if "triton" in got and "sdpa:flash" in got:
                    pairs.append((t, got["triton"] / got["sdpa:flash"]))
            name = f"ours against SDPA flash, {metric.removesuffix('_tflops')}, D={d}"
            if not pairs:
                goals.append(Goal.unmeasured(name, ">= 1.0x at T >= 2k"))
                continue
            value = ", ".join(f"T={t}: {r:.2f}x" for t, r in pairs)
            met = None if dry else min(r for _, r in pairs) >= 1.0
            goals.append(Goal(name, ">= 1.0x at T >= 2k", value, met))
    return goals


def _accuracy_goal(rows: list[dict]) -> Goal:
    """Met where every row was checked and passed; missed where one failed; not judged
    where some rows carry no check (rows kept from a call before the check), and not
    measured where none does."""
    name = "every kernel against the fp32 reference"
    target = f"error <= {FACTOR:g}x torch's fused kernel's + {FLOOR:g}"
    inaccurate = sorted({r["backend"] for r in rows if r.get("accurate") is False})
    unchecked = sorted({r["backend"] for r in rows if r.get("accurate") is None})
    if inaccurate:
        return Goal(name, target, f"outside: {', '.join(inaccurate)}", False)
    if all(r.get("accurate") is None for r in rows):
        return Goal.unmeasured(name, target)
    if unchecked:
        return Goal(
            name, target, f"within where checked; not checked: {', '.join(unchecked)}", None
        )
    return Goal(name, target, "all within", True)


def _result(rows: list[dict], notes: list[str], skipped: list[str], dry: bool) -> Result:
    s = DRY if dry else GPU
    notes = notes + (
        [f"not run, past the section's time limit: {'; '.join(skipped)}"] if skipped else []
    )
    goals = [*_speed_goals(rows, s, dry), _accuracy_goal(rows)]
    return Result(
        title="attention kernels, causal, with and without document masks",
        shapes=(
            f"B·T = {s['tokens']} tokens, H = {s['width']}/D, D in {s['head_dims']}, T in "
            f"{s['seq_lens']}, {str(s['dtype']).removeprefix('torch.')}; eager up to "
            f"T={s['eager_max_t']}; accuracy at B=1, H=4, T={s['check_t']}"
        ),
        columns=["backend", "head_dim", "seq_len", "batch", "docs", "fwd_ms", "fwd_bwd_ms",
                 "fwd_tflops", "fwd_bwd_tflops", "max_err_out", "max_err_grad", "accurate"],
        rows=rows,
        goals=goals,
        notes=notes,
    )  # fmt: skip


def _key(row: dict) -> tuple:
    return row["backend"], row["head_dim"], row["docs"], row["seq_len"]


def run(dry: bool) -> Result:
    s, dev = (DRY if dry else GPU), device(dry)
    stop_at = deadline(reserve_s=15)  # a row takes seconds once its kernel is compiled
    kept = {_key(r): r for r in earlier_rows()}  # a later record's row replaces an earlier's
    rows, notes, skipped, refused = list(kept.values()), [], [], {}
    if kept:
        notes.append(f"{len(kept)} rows kept from an earlier call on this device (--resume)")
    accuracy = Accuracy(s, dev)
    for name, d, docs, t in plan(s):
        if (name, d, docs, t) in kept:
            continue
        setting = f"{name}, D={d}, {'documents' if docs else 'causal'}"
        if (name, d, docs) not in refused:
            refused[name, d, docs] = why = refusal(name, d, docs, s, dev)
            if why is not None:
                notes.append(f"{setting}: not run: {why}")
        if refused[name, d, docs] is not None:
            continue
        if time.monotonic() > stop_at:
            skipped.append(f"{name} D={d} T={t}{' docs' if docs else ''}")
            continue
        try:
            row = {**measure(name, d, t, docs, s, dev), **accuracy.of(name, d, docs)}
        except Exception as e:  # a row that fails is reported; the sweep goes on
            notes.append(f"{setting}, T={t}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        rows.append(row)
        print(row, flush=True)
        write_partial_rows(_result(rows, notes, skipped, dry))
    return _result(rows, notes, skipped, dry)
