"""INT4 weight-only quantisation of a trained model (group size 128): AWQ's activation-aware
scale search against round-to-nearest (RTN) and the unquantised model, and torchao's INT4
weight-only quantisation beside them, on validation perplexity. Each job trains gpt2-mini
with a checkpoint at the end; the report loads it (llm.inference.load), calibrates AWQ on
sequences of the job's own train split, quantises the block linears (llm.inference.quantize:
the embedding and output head stay, as AWQ keeps them) and measures the mean loss on the
job's validation samples. Results are cached in each job's folder (quantization.json), so
re-running the report is cheap. Verdicts against Lin et al., 2023 (docs/references.md,
"AWQ"): AWQ's perplexity stays close to the unquantised model's, and below RTN's."""

from __future__ import annotations

import copy
import json
import math
import statistics

import matplotlib.pyplot as plt
import numpy as np
import torch

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, fmt
from experiments.sweep import Job
from llm.errors import LabError
from llm.inference.evaluation import evaluation_data
from llm.inference.load import load_for_inference
from llm.inference.quantize import (
    GROUP_SIZE,
    block_linears,
    quantize_model,
    sequence_losses,
    torchao_int4,
    weight_bytes,
)

REFS = "docs/references.md"
CACHE = "quantization.json"
VARIANTS = {
    "unquantised": "unquantised (fp32)",
    "rtn": "RTN INT4 g128",
    "awq": "AWQ INT4 g128",
    "torchao": "torchao INT4 g128",
}
# AWQ's Table 4, INT4 g128, WikiText-2: AWQ's perplexity over FP16's is 1.018 (LLaMA-13B)
# to 1.027 (Llama-2-70B, LLaMA-30B) across the 7 models.
PAPER_GAP = (1.0, 1.027)
# AWQ against RTN is told apart from noise when their paired per-sequence loss difference
# is at least this many standard errors from 0 on some seed.
SIGNIFICANT_SE = 2.0
GROUPS = ("attention_input", "attention_output", "mlp_input", "mlp_hidden")

CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "awq_near_fp16",
            "INT4 g128 AWQ keeps perplexity close to FP16's (WikiText-2, LLaMA 7B-65B, "
            "Llama-2 7B-70B)",
            "AWQ / FP16 perplexity 1.018-1.027 (e.g. Llama-2-7B 5.60 against 5.47)",
            f"Lin et al., 2023, MLSys 2024, arXiv:2306.00978, Table 4 ({REFS})",
            0.01,  # the spread of the paper's own seven gaps (1.8% to 2.7%)
            "validation perplexity of AWQ INT4 g128 / that of the unquantised model, per "
            "seed; the claim holds up to the paper's largest gap (2.7%) plus the tolerance",
        ),
        Claim(
            "awq_below_rtn",
            "at INT4 g128, AWQ's perplexity is below round-to-nearest's at every model size",
            "RTN / AWQ perplexity >= 1",
            f"Lin et al., 2023, arXiv:2306.00978, Table 4 ({REFS})",
            0.0,
            "validation perplexity of RTN INT4 g128 / that of AWQ INT4 g128; every seed "
            "must agree on the side of 1",
        ),
    )
}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def _read_back_weights(model: torch.nn.Module) -> None:
    """Each torchao-quantised block linear replaced by a float one holding the weight torchao
    computes with, read through its own kernel on the identity (W = f(I)^T - b): the same
    perplexity, where torchao's CPU kernel would take minutes over the validation set."""
    for name, linear in block_linears(model).items():
        k = linear.in_features
        eye = torch.eye(k, device=linear.weight.device, dtype=linear.weight.dtype)
        weight = linear(eye).T.float()  # (N, K), plus the bias in every column
        if linear.bias is not None:
            weight = weight - linear.bias[:, None]
        plain = torch.nn.Linear(k, linear.out_features, linear.bias is not None).to(weight.device)
        plain.weight.copy_(weight)
        if linear.bias is not None:
            plain.bias.copy_(linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)
    model.float()  # on CUDA torchao ran in bf16; every variant is evaluated in fp32


def measure(job: Job) -> dict:
    """Quantise the job's newest checkpoint three (four) ways and measure each; cached."""
    cache = job.dir / CACHE
    if cache.exists():
        return json.loads(cache.read_text())
    device = _device()
    loaded = load_for_inference(str(job.dir), None, device)
    digest, val, calibration = evaluation_data(job.config["data"])
    if digest != loaded.tokenizer.digest:
        return {"error": "the data's tokenizer is not the checkpoint's"}
    result = {"checkpoint": str(loaded.source), "step": loaded.step, "variants": {}}
    for name in VARIANTS:
        model = copy.deepcopy(loaded.model)
        row: dict = {}
        try:
            if name in ("rtn", "awq"):
                record = quantize_model(model, name, GROUP_SIZE, calibration)
                if record is not None:
                    row.update(alphas=record.alphas, errors=record.errors, outliers=record.outliers)
            row["bytes"] = weight_bytes(model)
            if name == "torchao":
                if device.type == "cuda":  # its CUDA layout takes bf16 weights only
                    model = model.to(torch.bfloat16)
                row["config"] = torchao_int4(model, GROUP_SIZE)
                row["bytes"] = weight_bytes(model)
                _read_back_weights(model)
            sums, counts = sequence_losses(model, val)
            row["loss"] = (sums.sum() / counts.sum()).item()
            row["sequence_losses"] = (sums / counts).tolist()
        except (LabError, ImportError, RuntimeError, AssertionError, NotImplementedError) as exc:
            row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        result["variants"][name] = row
    cache.write_text(json.dumps(result, indent=1))
    return result


def _measured(jobs: list[Job]) -> list[tuple[Job, dict]]:
    out = []
    for job in jobs:
        if job.failed:
            continue
        try:
            out.append((job, measure(job)))
        except LabError as exc:  # no checkpoint, or one that does not load
            out.append((job, {"error": str(exc)}))
    return out


def _ppl(row: dict | None) -> float | None:
    return None if not row or "loss" not in row else math.exp(row["loss"])


def _results_table(measured: list[tuple[Job, dict]]) -> Table:
    rows = []
    for job, m in measured:
        if "error" in m:
            rows.append((job.num, job.get("train.seed"), "-", m["error"], *["-"] * 5))
            continue
        v = m["variants"]
        base = _ppl(v["unquantised"])
        cells = []
        for name in VARIANTS:
            p = _ppl(v[name])
            if p is None:
                cells.append(f"not run: {v[name].get('error', '?')}")
            elif name == "unquantised":
                cells.append(fmt(p, digits=5))
            else:
                cells.append(f"{fmt(p, digits=5)} ({(p / base - 1) * 100:+.2f}%)")
        alphas = v["awq"].get("alphas", {})
        mean_alpha = statistics.mean(alphas.values()) if alphas else None
        d = paired_difference(m, "awq", "rtn")
        paired = "-" if d is None else f"{d[0]:+.5f} ± {d[1]:.5f}"
        rows.append((job.num, job.get("train.seed"), m["step"], *cells, paired, fmt(mean_alpha)))
    return Table(
        "Validation perplexity, unquantised and INT4 g128",
        ("job", "seed", "step", *VARIANTS.values(), "AWQ - RTN loss", "AWQ mean alpha"),
        rows,
        note="In brackets: the change against the unquantised model. AWQ - RTN loss: the "
        "mean over validation sequences of the difference of their losses, ± its standard "
        "error. AWQ's alpha is the searched exponent of s = mean|x|^alpha, averaged over the "
        "4 groups of each block (0 is RTN).",
    )


def _bytes_table(measured: list[tuple[Job, dict]]) -> Table:
    for _job, m in measured:
        if "variants" in m:
            v = m["variants"]
            base = v["unquantised"]["bytes"]
            rows = [
                (VARIANTS[n], fmt(v[n]["bytes"] / 2**20, " MiB"), f"{base / v[n]['bytes']:.2f}x")
                for n in VARIANTS
                if "bytes" in v[n]
            ]
            return Table(
                "Model bytes (weights, scales, zero points; embedding and head unquantised)",
                ("variant", "bytes", "smaller than fp32"),
                rows,
            )
    return Table("Model bytes", ("variant", "bytes", "smaller than fp32"), [])


def _ratios(measured, num: str, den: str) -> list[float]:
    out = []
    for _job, m in measured:
        v = m.get("variants", {})
        a, b = _ppl(v.get(num)), _ppl(v.get(den))
        if a is not None and b is not None:
            out.append(a / b)
    return out


def paired_difference(m: dict, a: str, b: str) -> tuple[float, float] | None:
    """Mean and standard error of variant ``a``'s loss minus ``b``'s over the same
    validation sequences; None where either did not run."""
    x = m.get("variants", {}).get(a, {}).get("sequence_losses")
    y = m.get("variants", {}).get(b, {}).get("sequence_losses")
    if not x or not y or len(x) < 2:
        return None
    d = [p - q for p, q in zip(x, y, strict=True)]
    return statistics.mean(d), statistics.stdev(d) / math.sqrt(len(d))


def _comparison(measured: list[tuple[Job, dict]]) -> Table:
    near = _ratios(measured, "awq", "unquantised")
    below = _ratios(measured, "rtn", "awq")
    paired = [d for _job, m in measured if (d := paired_difference(m, "awq", "rtn"))]
    rows = [
        compare(
            CLAIMS["awq_near_fp16"],
            f"gpt2-mini, {len(near)} seeds, mean",
            statistics.mean(near) if near else None,
            PAPER_GAP,
            "x",
        )
    ]
    reason = None
    if below and len({r >= 1 for r in below}) > 1:
        reason = (
            "the seeds disagree on the side of 1 (" + ", ".join(f"{r:.4f}" for r in below) + ")"
        )
    elif paired and all(abs(mean) < SIGNIFICANT_SE * se for mean, se in paired):
        reason = (
            "AWQ and RTN are within noise: their validation loss differs by "
            + ", ".join(f"{mean:+.5f} ± {se:.5f}" for mean, se in paired)
            + f" (per seed, paired over sequences, ± 1 SE; under {SIGNIFICANT_SE:g} SE)"
        )
    rows.append(
        compare(
            CLAIMS["awq_below_rtn"],
            f"gpt2-mini, {len(below)} seeds, mean",
            statistics.mean(below) if below else None,
            (1.0, math.inf),
            "x",
            not_comparable=reason,
        )
    )
    return Table("Comparison with the claims", COMPARISON_COLUMNS, rows)


def _search_table(measured: list[tuple[Job, dict]]) -> Table:
    """Per group of linears sharing an input, over blocks and seeds: the alpha AWQ chose,
    its output MSE against RTN's (alpha 0), and how far the largest channel stands out."""
    rows = []
    for group in GROUPS:
        alphas, ratios, outliers = [], [], []
        for _job, m in measured:
            awq = m.get("variants", {}).get("awq", {})
            for key, alpha in awq.get("alphas", {}).items():
                if key.endswith(group):
                    alphas.append(alpha)
                    rtn, best = awq["errors"][key]
                    ratios.append(best / rtn if rtn > 0 else 1.0)
                    outliers.append(awq["outliers"][key])
        if alphas:
            rows.append((group, len(alphas), fmt(statistics.mean(alphas)),
                         fmt(statistics.mean(ratios)), fmt(min(ratios)),
                         fmt(statistics.median(outliers)), fmt(max(outliers))))  # fmt: skip
    return Table(
        "AWQ's search per group of linears (over blocks and seeds)",
        (
            "group",
            "searches",
            "mean alpha",
            "MSE / RTN's, mean",
            "MSE / RTN's, best",
            "max/median mean|x|, median",
            "max/median mean|x|, max",
        ),
        rows,
        note="MSE: the output error of the group's sub-module (attention, MLP, or the linear "
        "itself) on the calibration inputs, AWQ's best alpha against alpha 0 (RTN). "
        "max/median mean|x|: the most salient input channel's mean magnitude over the "
        "median channel's.",
    )


def report(jobs: list[Job]) -> list[Table]:
    measured = _measured(jobs)
    return [
        _results_table(measured),
        _search_table(measured),
        _bytes_table(measured),
        _comparison(measured),
    ]


def plots(jobs: list[Job]) -> dict[str, plt.Figure]:
    measured = [(j, m) for j, m in _measured(jobs) if "variants" in m]
    if not measured:
        return {}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [n for n in VARIANTS if any(_ppl(m["variants"][n]) for _j, m in measured)]
    for k, (job, m) in enumerate(measured):
        values = [_ppl(m["variants"][n]) or float("nan") for n in names]
        offsets = np.arange(len(names)) + (k - (len(measured) - 1) / 2) * 0.8 / len(measured)
        ax.bar(offsets, values, width=0.8 / len(measured), label=f"seed {job.get('train.seed')}")
    low = min(_ppl(m["variants"]["unquantised"]) for _j, m in measured)
    ax.set_ylim(low * 0.98, None)
    ax.set_xticks(range(len(names)), [VARIANTS[n] for n in names], rotation=15)
    ax.set_ylabel("validation perplexity")
    ax.legend()
    return {"quantization_perplexity": fig}
