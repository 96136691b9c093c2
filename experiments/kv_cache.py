"""The KV cache against its formula, 2 x n_layers x n_kv_heads x head_dim x element bytes per
token, for multi-head (MHA), grouped-query (GQA, n_heads / 4 kv heads) and multi-query (MQA,
one kv head) attention: one llama shape trained three times from the same seed, each
checkpoint's cache measured by the live-tensor tracker, what a fixed memory budget holds,
decode tokens/s, and the validation loss each variant reaches (Shazeer, 2019; Ainslie et al.,
2023). Then vLLM's PagedAttention (Kwon et al., 2023) at our scale: one mixed-length
workload served with continuous batching through a contiguous cache that reserves each
request's maximum length and through paged pools of the same bytes: the share of reserved
memory holding token states, how many requests run together, and the throughput."""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, fmt
from experiments.kv_cache_measure import (
    BUDGET_SEQUENCES,
    DECODE,
    ROWS,
    SERVED,
    VLLM_BLOCK,
    measure,
    scaled_block,
    serve_all,
)
from experiments.series import smoothed
from experiments.sweep import FOLLOW_UP, Job
from llm.errors import LabError

REFS = "docs/references.md"
KWON = f"Kwon et al., SOSP 2023, arXiv:2309.06180 ({REFS})"
MIB = 2**20
VARIANTS = ("MHA", "GQA", "MQA")
SMOOTHING = 5  # training losses: the trailing mean of this many logged steps

CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "kv_formula",
            "a token's KV cache is 2 (K and V) x n_layers x n_kv_heads x head_dim x element bytes",
            "2 L Hkv D b",
            f"Shazeer, 2019, arXiv:1911.02150; Ainslie et al., 2023, arXiv:2305.13245 ({REFS})",
            0.0,
            "bytes the peak tracker counts alive after building a cache (a contiguous one of 4 "
            "max_seq_len rows, a paged pool of 64 blocks of 16) / its tokens, over the formula",
        ),
        Claim(
            "kv_scaling",
            "grouped-query and multi-query attention shrink the cache by n_heads / n_kv_heads",
            "n_heads / n_kv_heads",
            f"Ainslie et al., 2023, arXiv:2305.13245 ({REFS})",
            0.0,
            "MHA's measured bytes per token / the variant's",
        ),
        Claim(
            "gqa_quality",
            "uptrained GQA-8 reaches quality close to multi-head attention (T5-XXL: average "
            "47.1 against MHA's 47.2) at close to MQA's speed",
            "ratio 1 (47.1 / 47.2 = 0.998 of the score)",
            f"Ainslie et al., 2023, arXiv:2305.13245, Table 1 ({REFS})",
            0.01,
            "final validation loss GQA / MHA (same seed and batches), trained from scratch",
        ),
        Claim(
            "mqa_quality",
            "multi-query attention incurs only minor quality degradation from the baseline",
            "loss ratio 1.003 (LM1B dev ln 30.2 / ln 29.9) to 1.011 (WMT14 dev ln(PPL) "
            "1.439 / 1.424)",
            f"Shazeer, 2019, arXiv:1911.02150, Tables 1 and 3 ({REFS})",
            0.01,
            "final validation loss MQA / MHA (same seed and batches), trained from scratch",
        ),
        Claim(
            "prealloc_share",
            "existing systems (Orca, FasterTransformer) store token states in only 20.4%-38.2% "
            "of their KV cache memory: 60-80% is reserved, fragmented or never used",
            "20.4% (Orca (Max)) - 38.2% (Orca (Oracle))",
            KWON + ", section 3 and Fig. 2",
            0.1,
            "contiguous cache with a max_seq_len row per request: tokens cached / tokens "
            "reserved, at every decode step, averaged",
        ),
        Claim(
            "paged_share",
            "with PagedAttention memory is wasted only in a sequence's last block: under 4%",
            ">= 96% (Fig. 2: 96.3%)",
            KWON + ", Fig. 2; vLLM blog, 2023-06-20",
            0.0,
            "paged pool of the same bytes: tokens cached / tokens in the blocks taken, at "
            "every decode step, averaged",
        ),
        Claim(
            "batched_requests",
            "paging batches more requests at once: OPT-13B on ShareGPT, 30.42 against Orca "
            "(Max)'s 7.00",
            "4.3x",
            KWON + ", section 6.2 and Fig. 13a",
            0.25,
            "mean requests per decode step while requests were waiting (the cache full): "
            "paged / contiguous",
        ),
        Claim(
            "throughput",
            "vLLM improves throughput 2-4x at the same latency over FasterTransformer and Orca",
            "2-4x",
            KWON + ", abstract",
            0.0,
            "generated tokens / engine seconds for the whole workload: paged / contiguous "
            "(a GPU claim: judged where a decode step's time barely grows with the batch)",
        ),
    )
}


def variant(job: Job) -> str:
    heads, kv = int(job.get("model.n_heads")), int(job.get("model.n_kv_heads", 0) or 0)
    return "MHA" if kv == heads else "MQA" if kv == 1 else "GQA"


def main_jobs(jobs: list[Job]) -> dict[str, Job]:
    """The finished job of each variant in the first sweep (the follow-up adds a seed)."""
    return {variant(j): j for j in jobs if not j.failed and not j.num.startswith(FOLLOW_UP)}


def follow_up(jobs: list[Job]) -> list[list[str]]:
    """Once: MHA at the next seed, the loss comparison's yardstick of seed-to-seed noise."""
    mha = main_jobs(jobs).get("MHA")
    if mha is None or any(j.num.startswith(FOLLOW_UP) for j in jobs):
        return []
    heads, seed = int(mha.get("model.n_heads")), int(mha.get("train.seed"))
    return [[f"model.n_kv_heads={heads}", f"train.seed={seed + 1}"]]


def _measured(jobs: dict[str, Job]) -> tuple[dict[str, dict], dict[str, str]]:
    """Each variant's measurements, and why a variant could not be measured."""
    out, why = {}, {}
    for name, job in jobs.items():
        try:
            out[name] = measure(job)
        except LabError as exc:
            why[name] = str(exc)
    return out, why


def paired_gaps(job: Job, mha: Job | None) -> list[tuple[int, float]]:
    """The job's smoothed training loss minus MHA's at the same steps: the same seed sees
    the same batches, so the batch-to-batch noise cancels."""
    if mha is None or mha.failed:
        return []
    base = dict(smoothed(mha.metric("loss"), SMOOTHING))
    return [(s, v - base[s]) for s, v in smoothed(job.metric("loss"), SMOOTHING) if s in base]


def second_half_gap(job: Job, mha: Job | None) -> float | None:
    gaps = paired_gaps(job, mha)
    if not gaps:
        return None
    last = gaps[-1][0]
    return statistics.mean(g for s, g in gaps if s > last / 2)


def val_loss(job: Job | None) -> float | None:
    return None if job is None or job.failed else job.summary.get("final_val_loss")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.4f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < MIB else f"{n / MIB:,.2f} MiB"


def variants_table(jobs: dict[str, Job], measured: dict[str, dict]) -> Table:
    base = val_loss(jobs.get("MHA"))
    rows = []
    for name in VARIANTS:
        m = measured.get(name)
        if m is None:
            continue
        t = m["max_seq_len"]
        loss = val_loss(jobs[name])
        rows.append(
            (
                name,
                m["n_kv_heads"],
                fmt(m["formula"]),
                fmt(m["contiguous"]),
                fmt(m["paged"]),
                _kib(m["contiguous"] * t),
                fmt(m["budget_tokens"]),
                m["budget_batch"],
                _rate(m["decode_tokens_per_s"]),
                _rate(m["budget_decode_tokens_per_s"]),
                fmt(jobs[name].summary.get("n_params")),
                "-" if loss is None else f"{loss:.4f}",
                "-" if loss is None or base is None else f"{loss - base:+.4f}",
                _signed(second_half_gap(jobs[name], jobs.get("MHA"))),
            )
        )
    first = next(iter(measured.values()), None)
    budget = "-" if first is None else _kib(first["budget_bytes"])
    t = "-" if first is None else first["max_seq_len"]
    return Table(
        "The cache of each variant",
        (
            "variant",
            "n_kv_heads",
            "bytes/token (formula)",
            "bytes/token (tracked, contiguous)",
            "bytes/token (tracked, paged)",
            f"cache of one {t}-token sequence",
            f"longest context in {budget}",
            f"largest batch of {t} tokens in {budget}",
            f"decode tokens/s ({DECODE[0]} x {DECODE[2]} new)",
            "decode tokens/s at that batch",
            "parameters",
            "final val loss",
            "vs MHA",
            "train loss vs MHA, 2nd half (same batches)",
        ),
        rows,
        note=f"The budget is MHA's cache for {BUDGET_SEQUENCES} sequences of max_seq_len; a "
        "longest context past max_seq_len is the budget's room, not what the model attends to. "
        f"Decode tokens/s: greedy, the median of 3 runs (one CPU thread on a CPU). "
        "Fewer kv heads also mean fewer parameters (smaller K and V projections): "
        "Shazeer widened the MLP to equal them, Ainslie et al. uptrained MHA checkpoints; "
        "here every variant trains from scratch at the same d_ff.",
    )


def kv_rows(jobs: dict[str, Job], measured: dict[str, dict], noise: float | None) -> list:
    rows = []
    for name, m in measured.items():
        for kind in ("contiguous", "paged"):
            rows.append(
                compare(
                    CLAIMS["kv_formula"],
                    f"{name}, {kind}, {m['dtype']}",
                    m[kind] / m["formula"],
                    1.0,
                    "x",
                )
            )
    mha = measured.get("MHA")
    for name in ("GQA", "MQA"):
        m = measured.get(name)
        if m is not None and mha is not None:
            rows.append(
                compare(
                    CLAIMS["kv_scaling"],
                    f"{name}: {m['n_heads']} / {m['n_kv_heads']} heads",
                    mha["contiguous"] / m["contiguous"],
                    m["n_heads"] / m["n_kv_heads"],
                    "x",
                )
            )
    spread = "" if noise is None else f"; MHA's next seed / this one: {noise:.4f}"
    base = val_loss(jobs.get("MHA"))
    for name, key, paper in (("GQA", "gqa_quality", 1.0), ("MQA", "mqa_quality", (1.003, 1.011))):
        rows.append(
            compare(
                CLAIMS[key],
                f"{name} / MHA, final val loss{spread}",
                _ratio(val_loss(jobs.get(name)), base),
                paper,
                "x",
            )
        )
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _step_ms(fit: dict | None) -> str:
    if fit is None:
        return "-"
    slope = 1e3 * fit["per_request_s"]
    sign = "-" if slope < 0 else "+"
    return f"{1e3 * fit['intercept_s']:.2f} {sign} {abs(slope):.3f} x batch"


def _run_name(name: str, scaled: int) -> str:
    if name == "contiguous":
        return "contiguous (max_seq_len rows)"
    block = int(name.removeprefix("paged_"))
    why = "vLLM's default" if block == VLLM_BLOCK else "16 scaled like the lengths"
    return f"paged, block {block} ({why})" + (" *" if block == scaled else "")


def serving_table(served: dict) -> Table:
    scaled = scaled_block(served["max_seq_len"])
    rows = []
    for name, r in served["runs"].items():
        recomputed = r["prefill_tokens"] - r["prompt_tokens"]
        rows.append(
            (
                _run_name(name, scaled),
                f"{fmt(r['pool_tokens'])} ({_kib(r['pool_bytes'])})",
                _pct(r["token_share"]),
                _pct(r["token_share_saturated"]),
                _pct(r["audit_share"]),
                "every step" if r["bookkeeping_agrees"] else "not always",
                _pct(r["token_share_of_pool"]),
                _pct(r["written_share"]),
                f"{r['mean_running']:.2f} / {fmt(r['mean_running_saturated'])}",
                r["max_running"],
                f"{r['preemptions']} ({fmt(recomputed)} tokens)",
                _rate(r["tokens_per_s"]),
                _step_ms(r["step_time"]),
                f"{r['same_tokens']} / {served['requests']}",
            )
        )
    return Table(
        "Serving one mixed-length workload",
        (
            "cache",
            "pool: tokens (tracked bytes)",
            "token states / reserved",
            "same, while requests wait",
            "same, counted from the requests",
            "cache's token count = the requests'",
            "token states / pool",
            "pool slots ever written",
            "requests per decode step: mean / while waiting",
            "most at once",
            "preemptions (tokens prefilled again)",
            "generated tokens/s",
            "decode step (ms)",
            "same greedy tokens as contiguous",
        ),
        rows,
        note=f"{served['requests']} requests, prompt and output lengths drawn log-normal "
        f"(sigma 1) with ShareGPT's means (161.31 and 337.99 tokens, Kwon et al. Fig. 11) "
        f"scaled by max_seq_len / 2048: means {served['mean_prompt']:.1f} and "
        f"{served['mean_new']:.1f} here; each request ends at its drawn output length. One "
        f"budget for all: {ROWS} rows of max_seq_len. Shares are means over decode steps. "
        "'Counted from the requests' divides each running request's tokens (prompt and "
        "output but the newest) by the tokens the free lists say are taken; 'slots ever "
        "written' counts the pool's non-zero slots after the run (pools start as zeros): "
        "what the contiguous cache never touched was never needed. Decode step: a linear "
        "fit of the steps that prefilled nothing. * the paged run the claims use.",
    )


def paging_rows(served: dict, device: str) -> list:
    runs = served["runs"]
    contiguous = runs["contiguous"]
    scaled = f"paged_{scaled_block(served['max_seq_len'])}"
    rows = [
        compare(
            CLAIMS["prealloc_share"],
            "contiguous, each request a max_seq_len row",
            100 * contiguous["token_share"],
            (20.4, 38.2),
            "%",
        )
    ]
    for name, r in runs.items():
        if name != "contiguous":
            rows.append(
                compare(
                    CLAIMS["paged_share"],
                    _run_name(name, -1),
                    100 * r["token_share"],
                    (96.0, 100.0),
                    "%",
                )
            )
    paged = runs[scaled]
    rows.append(
        compare(
            CLAIMS["batched_requests"],
            _run_name(scaled, -1),
            _ratio(paged["mean_running_saturated"], contiguous["mean_running_saturated"]),
            4.3,
            "x",
        )
    )
    ratio = paged["tokens_per_s"] / contiguous["tokens_per_s"]
    rows.append(
        compare(
            CLAIMS["throughput"],
            _run_name(scaled, -1),
            ratio,
            (2.0, 4.0),
            "x",
            not_comparable=_cpu_reason(paged, contiguous, ratio) if device == "cpu" else None,
        )
    )
    return rows


def _cpu_reason(paged: dict, contiguous: dict, ratio: float) -> str:
    """Why a CPU's throughput ratio does not test the claim, with the figures it came from."""
    batches = paged["mean_running"] / contiguous["mean_running"]
    recomputed = paged["prefill_tokens"] - paged["prompt_tokens"]
    fits = ""
    if contiguous["step_time"] is not None and paged["step_time"] is not None:
        fits = (
            f" Decode steps here: {_step_ms(contiguous['step_time'])} ms contiguous, "
            f"{_step_ms(paged['step_time'])} ms paged."
        )
    return (
        f"{ratio:.2f}x measured on a CPU, with {batches:.2f}x the requests a step. The paper's "
        "figure is a GPU's: a decode step at these batches is memory-bound there, its time "
        "barely grows with the batch, and the batch ratio becomes the throughput ratio. A "
        f"CPU step computes per request instead.{fits} {paged['preemptions']} preemptions "
        f"prefilled {recomputed:,} tokens again. The GPU scale judges it"
    )


def report(jobs: list[Job]) -> list[Table]:
    main = main_jobs(jobs)
    measured, why = _measured(main)
    noise = next(
        (
            _ratio(val_loss(j), val_loss(main.get("MHA")))
            for j in jobs
            if j.num.startswith(FOLLOW_UP) and not j.failed and variant(j) == "MHA"
        ),
        None,
    )
    tables = [variants_table(main, measured)]
    note = "; ".join(f"{name} not measured: {reason}" for name, reason in why.items())
    rows = kv_rows(main, measured, noise)
    served = None
    if "MHA" in measured:
        served = serve_all(main["MHA"])
        rows += paging_rows(served, measured["MHA"]["device"])
    tables.append(Table("Comparison with the papers", COMPARISON_COLUMNS, rows, note=note))
    if served is not None:
        tables.append(serving_table(served))
    return tables


def plots(jobs: list[Job]) -> dict:
    out = {}
    main = main_jobs(jobs)
    if main:
        out["kv_cache_loss"] = _loss_plot(main, [j for j in jobs if j.num.startswith(FOLLOW_UP)])
    mha = main.get("MHA")
    if mha is not None and (mha.dir / SERVED).exists():
        out["kv_cache_paging"] = _paging_plot(serve_all(mha))
    return out


def _loss_plot(main: dict[str, Job], extra: list[Job]):
    fig, (curves, paired) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for j in [*main.values(), *extra]:
        curve = [] if j.failed else smoothed(j.metric("loss"), SMOOTHING)
        if not curve:  # failed, or fewer logged steps than one smoothing window
            continue
        tail = "" if j in main.values() else f", seed {j.get('train.seed')}"
        label = f"{variant(j)} ({j.get('model.n_kv_heads')} kv heads{tail})"
        curves.plot(*zip(*curve, strict=True), label=label)
        gaps = paired_gaps(j, main.get("MHA")) if j in main.values() else []
        if gaps:
            paired.plot(*zip(*gaps, strict=True), label=label)
    curves.set_ylabel(f"training loss (mean of {SMOOTHING} logged)")
    curves.set_title("Training loss of each variant")
    paired.axhline(0, color="grey", linewidth=0.8)
    paired.set_ylabel("minus MHA's, same step and batch")
    paired.set_xlabel("step")
    for ax in (curves, paired):
        if ax.get_legend_handles_labels()[0]:  # a labelled line (not only the zero line)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _paging_plot(served: dict):
    scaled = scaled_block(served["max_seq_len"])
    fig, (share, batch) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for name, r in served["runs"].items():
        label = _run_name(name, scaled).removesuffix(" *")
        share.plot([100 * u / res for u, res in r["occupancy"]], label=label, linewidth=0.8)
        batch.plot(r["batches"], label=label, linewidth=0.8)
    share.axhspan(20.4, 38.2, color="grey", alpha=0.2, label="Kwon et al.: existing systems")
    share.axhline(96.3, color="grey", linestyle="--", linewidth=0.8, label="Kwon et al.: vLLM")
    share.set_ylabel("token states / reserved (%)")
    share.set_title(f"One workload of {served['requests']} requests, one KV budget")
    share.legend(fontsize=8)
    batch.set_ylabel("requests in the decode step")
    batch.set_xlabel("decode step")
    fig.tight_layout()
    return fig
