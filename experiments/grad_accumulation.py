"""Gradient accumulation: k micro-batches of b against one batch of k·b sequences, on padded
documents of unequal length (data.packing=false). The Trainer normalises the summed token
loss by the target tokens of the whole accumulated batch (docs/design.md, note 2), so the
loss curves should match the one-batch run and gradient memory should not depend on k.
The Trainer's own step-1 loss is measured against the one-batch run's; the counter-example,
the normalisation transformers used before PR 34191 (issue 37766), the mean of each
micro-batch's mean, which weighs a short document's tokens more, is derived: computed on a
fixed synthetic example, no run behind it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from experiments.claims import COMPARISON_COLUMNS, Claim, Table, compare, derived_table
from experiments.sweep import Job

SOURCE = (
    "design articles' claim (docs/references.md); transformers issue 37766 and PR 34191 "
    "(github.com/huggingface/transformers)"
)
CLAIMS = {
    c.key: c
    for c in (
        Claim(
            "equal_loss",
            "k x b accumulated equals one batch of k·b when the loss is normalised per token "
            "over the whole accumulated batch",
            "equal updates (ratio 1)",
            SOURCE,
            1e-3,
            "training loss of every logged step / the k=1 run's at that step; the step "
            "furthest from 1 is shown (fp32, dropout 0)",
        ),
        Claim(
            "grad_memory",
            "gradient-buffer memory is independent of the number of accumulated micro-batches",
            "ratio 1",
            SOURCE,
            0.0,
            "rank 0's gradient bytes (summary.json model_state_bytes[0].grads) / the k=1 run's",
        ),
        Claim(
            "per_token_normalisation",
            "normalised per token over the whole accumulated batch, k micro-batches holding "
            "different numbers of target tokens give the large-batch loss",
            "ratio 1",
            SOURCE,
            1e-6,
            "the Trainer's logged loss of step 1 (the same weights and sequences for every k) "
            "/ the k=1 run's",
        ),
        Claim(
            "mean_of_means",
            "the per-micro-batch mean (the old transformers loss) differs from the large-batch "
            "loss when micro-batches hold different numbers of target tokens",
            "ratio 1 only when every micro-batch holds as many target tokens",
            SOURCE,
            1e-6,
            "a fixed example, 8 documents of 5-128 target tokens, random logits (seed 0) "
            "sharper document by document: the mean of the k micro-batch means / the "
            "one-batch per-token mean",
            derived=True,
        ),
    )
}
# Target tokens of the counter-example's documents: unequal, as padded documents are.
DOC_LENGTHS = (120, 7, 64, 33, 128, 5, 90, 12)


def accum_steps(job: Job) -> int:
    return int(job.get("train.grad_accum_steps", 1))


def micro_batch(job: Job) -> int:
    return int(job.get("train.micro_batch_size", 1))


def setting(job: Job) -> str:
    return f"k={accum_steps(job)} x b={micro_batch(job)}"


def _reference(jobs: list[Job]) -> Job | None:
    return next((j for j in jobs if accum_steps(j) == 1 and not j.failed), None)


def loss_ratio(job: Job, ref: Job) -> float | None:
    """The logged step's loss / the reference's, at the step furthest from 1."""
    ours, theirs = dict(job.metric("loss")), dict(ref.metric("loss"))
    ratios = [ours[s] / theirs[s] for s in ours if s in theirs]
    return max(ratios, key=lambda r: abs(r - 1)) if ratios else None


def grad_ratio(job: Job, ref: Job) -> float:
    return (
        job.summary["model_state_bytes"][0]["grads"] / ref.summary["model_state_bytes"][0]["grads"]
    )


def first_step_ratio(job: Job, ref: Job) -> float | None:
    """The Trainer's step-1 loss of ``job`` / the k=1 run's: the same weights and the same
    sequences, split into k micro-batches of unequal target tokens."""
    ours, theirs = dict(job.metric("loss")), dict(ref.metric("loss"))
    return ours[1] / theirs[1] if 1 in ours and 1 in theirs else None


def split_losses(k: int) -> tuple[float, float]:
    """(one batch's per-token mean, k-way split as the mean of micro-batch means) on the
    fixed example."""
    g = torch.Generator().manual_seed(0)
    vocab, longest = 256, max(DOC_LENGTHS)
    # Sharper logits for later documents: their tokens' losses differ from the first ones'.
    sharpness = torch.linspace(0.5, 4.0, len(DOC_LENGTHS)).view(-1, 1, 1)
    logits = torch.randn(len(DOC_LENGTHS), longest, vocab, generator=g) * sharpness
    targets = torch.randint(0, vocab, (len(DOC_LENGTHS), longest), generator=g)
    for i, n in enumerate(DOC_LENGTHS):
        targets[i, n:] = -100  # padding carries no loss
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    mask = targets != -100
    whole = per_token.sum() / mask.sum()
    parts = torch.arange(len(DOC_LENGTHS)).chunk(k)
    mean_of_means = sum(per_token[p].sum() / mask[p].sum() for p in parts) / k
    return whole.item(), mean_of_means.item()


def report(jobs: list[Job]) -> list[Table]:
    ref = _reference(jobs)
    no_ref = None if ref is not None else "the k=1 reference job failed"
    loss_rows, mem_rows = [], []
    for j in jobs:
        if accum_steps(j) == 1:
            continue
        ok = not j.failed and ref is not None
        loss_rows.append(
            compare(
                CLAIMS["equal_loss"],
                f"{setting(j)} vs k=1",
                loss_ratio(j, ref) if ok else None,
                1.0,
                not_comparable=no_ref,
            )
        )
        mem_rows.append(
            compare(
                CLAIMS["grad_memory"],
                f"{setting(j)} vs k=1",
                grad_ratio(j, ref) if ok else None,
                1.0,
                not_comparable=no_ref,
            )
        )
    first_step = []
    accumulated = sorted((j for j in jobs if accum_steps(j) != 1), key=accum_steps)
    for j in accumulated:
        ok = not j.failed and ref is not None
        first_step.append(
            compare(
                CLAIMS["per_token_normalisation"],
                f"k={accum_steps(j)}: the Trainer's step-1 loss, per token over the batch",
                first_step_ratio(j, ref) if ok else None,
                1.0,
                not_comparable=no_ref,
            )
        )
    return [
        Table("Loss curves against one large batch", COMPARISON_COLUMNS, loss_rows),
        Table("Gradient memory against k", COMPARISON_COLUMNS, mem_rows),
        Table(
            "The Trainer's step-1 loss against one batch",
            COMPARISON_COLUMNS,
            first_step,
            note="The Trainer's own loss on the run's accumulated micro-batches against the "
            "one-batch run's, at step 1 (same weights, same sequences).",
        ),
        counter_example_table(sorted({accum_steps(j) for j in accumulated})),
    ]


def counter_example_table(ks: list[int]) -> Table:
    """The old normalisation on the fixed example, at each k: no run behind it."""
    rows = []
    for k in ks:
        whole, mean_of_means = split_losses(k)
        setting = f"k={k}: mean of micro-batch means / one-batch per-token mean"
        rows.append(compare(CLAIMS["mean_of_means"], setting, mean_of_means / whole, 1.0))
    return derived_table(
        "Counter-example: the per-micro-batch mean on a fixed example",
        rows,
        note="The normalisation transformers used before PR 34191, computed on 8 documents "
        "of unequal target tokens: formula disagrees is the claim (the mean of means is not "
        "the large-batch loss), which is why the Trainer counts target tokens globally.",
    )


def plots(jobs: list[Job]) -> dict:
    ref = _reference(jobs)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for j in jobs:
        if j.failed:
            continue
        steps, losses = zip(*j.metric("loss"), strict=True)
        top.plot(steps, losses, label=setting(j), marker=".")
        if ref is not None and j is not ref:
            theirs = dict(ref.metric("loss"))
            rel = [
                (s, v / theirs[s] - 1) for s, v in zip(steps, losses, strict=True) if s in theirs
            ]
            bottom.plot(*zip(*rel, strict=True), label=setting(j), marker=".")
    top.set_ylabel("training loss")
    if top.lines:
        top.legend()
    top.set_title("k micro-batches of b against one batch of k·b")
    bottom.set_ylabel("loss / k=1 loss - 1")
    bottom.set_xlabel("step")
    if bottom.lines:
        bottom.legend()
    return {"grad_accumulation": fig}
