"""bf16 mixed precision under every data-parallel strategy against one bf16 process.

Tolerance: the strategies differ from the reference only in where bf16 rounding happens:
our ZeRO and DeepSpeed keep bf16 working weights (so bf16 embeddings, norm gains and
residual stream) where the reference autocasts fp32 weights, and every multi-rank run
splits the batch, which changes the shapes of bf16 matmuls and the order of the fp32
gradient sums. Each is a rounding at bf16's unit roundoff u = 2^-8. The loss, a mean over
thousands of tokens, averages those differences out to well under u: we allow u/2 = 2^-9
(measured: 6e-4 at most over 8 steps). A gradient norm is dominated by its largest
elements, so we allow one bf16 ulp, 2^-7 (measured: 2.6e-3 at most). Errors of the kind these
tests exist for (gradients summed instead of averaged, a micro-batch or a bucket missing,
a reduction in the wrong dtype overflowing) move the norm by far more.
"""

from __future__ import annotations

import pytest
from helpers import read_metrics, run

STEPS = ("train.max_steps=8", "precision=bf16")
LOSS_TOL, NORM_TOL = 2**-9, 2**-7


def _curves(out) -> tuple[list[float], list[float]]:
    metrics = [m for m in read_metrics(out) if "loss" in m]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("bf16_reference")
    _, out = run(tmp, "single", text_corpus, cache_dir, "train.micro_batch_size=8", *STEPS)
    return _curves(out)


@pytest.mark.parametrize(
    "strategy",
    [
        ("parallelism=zero1",),
        ("parallelism=zero2",),
        ("parallelism=zero3",),
        # ddp's replicas are checked for every precision in test_replica_precision.py.
        pytest.param(("parallelism=ddp",), marks=pytest.mark.slow),
        ("parallelism=fsdp",),
        # DeepSpeed takes minutes per run on 2 CPU cores.
        pytest.param(("parallelism=deepspeed", "parallelism.zero_stage=1"), marks=pytest.mark.slow),
        pytest.param(("parallelism=deepspeed", "parallelism.zero_stage=2"), marks=pytest.mark.slow),
        pytest.param(("parallelism=deepspeed", "parallelism.zero_stage=3"), marks=pytest.mark.slow),
    ],
    ids=lambda s: "-".join(o.split("=")[1] for o in s),
)
@pytest.mark.slow
def test_bf16_matches_one_bf16_process(tmp_path, text_corpus, cache_dir, bf16_reference, strategy):
    _, out = run(
        tmp_path,
        "run",
        text_corpus,
        cache_dir,
        *strategy,
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=4",
        *STEPS,
    )
    ref_losses, ref_norms = bf16_reference
    losses, norms = _curves(out)
    assert len(losses) == len(ref_losses) == 8
    assert losses == pytest.approx(ref_losses, rel=LOSS_TOL)
    assert norms == pytest.approx(ref_norms, rel=NORM_TOL)
