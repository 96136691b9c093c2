"""No host read on a step that is not logged (issue 39, section 2): a real small run per
strategy and optimizer, with ``Tensor.item``, ``tolist``, ``__bool__``, ``__float__`` and
``__int__`` counted on the path of each step that is neither logged nor a probe
(benchmarks/profile_step's counter, inside the ranks: tests/host_read_ranks.py).

- torch's fused AdamW (the default) skips a non-finite step on the device: 0 reads, dense
  and MoE, on every strategy;
- every other optimizer cannot take ``found_inf``: at most the one read of the skip decision
  (llm/parallel/step.py);
- expert parallelism with the grouped kernel reads nothing either (the padded exchange);
  with the loop kernel, which reads its experts' counts, one read per MoE layer and
  micro-batch, in the exchange, and nothing else.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose_config, run, small_run_overrides
from host_read_ranks import counted_main
from torch import nn

from llm.config import OptimizerConfig, ParallelismConfig
from llm.data import prepare_data
from llm.errors import TrainingError
from llm.launch.launcher import _spawn, free_port, prepare_for_ranks
from llm.models.shapes import MODEL_SHAPES
from llm.parallel.dist import RankEnv
from llm.parallel.mesh import ParallelDims
from llm.parallel.single import SingleStrategy
from llm.parallel.step import settle_skip
from llm.precision import disabled_loss_scaler, resolve_precision

STEPS = 4  # steps 1 and 4 are logged and probe; 2 and 3 are counted
TWO = ("launcher.nproc_per_node=2", "train.micro_batch_size=2")
MOE = ("model=moe-tiny", "model.moe.kernel=grouped")  # the loop kernel reads counts per layer


def _host_reads(tmp_path, text_corpus, cache_dir, monkeypatch, *extra) -> list[dict]:
    """Every rank's reads on each counted step and whether its optimizer's param groups are
    fused: [{"reads": {step: [row, ...]}, "fused": [...]}, ...] by rank."""
    out = tmp_path / "run"
    overrides = small_run_overrides(out, text_corpus, cache_dir, *extra)
    cfg = prepare_for_ranks(
        compose_config([*overrides, f"train.max_steps={STEPS}", "train.log_every=100"])
    )
    prepare_data(cfg.data)
    n = cfg.launcher.nproc_per_node
    if n == 1:
        monkeypatch.setenv("LOCAL_RANK", "0")
        counted_main(cfg, RankEnv(0, 0, 1, cfg.launcher.master_addr, free_port()))
    else:
        _spawn(cfg, n, counted_main)
    ranks = [json.loads((out / f"host_reads_rank{r}.json").read_text()) for r in range(n)]
    assert all(sorted(int(s) for s in rank["reads"]) == [2, 3] for rank in ranks)
    return ranks


def _reads(ranks: list[dict]) -> list[int]:
    """The most reads a rank made on a counted step, per rank."""
    return [max(sum(r["count"] for r in rows) for rows in rank["reads"].values()) for rank in ranks]


ADAMW_CASES = [
    pytest.param(("parallelism=single",), id="single"),
    pytest.param(("parallelism=zero2", *TWO), id="zero2"),
    pytest.param(("parallelism=single", *MOE), id="moe-single"),
    *(
        pytest.param(extra, id=name, marks=pytest.mark.slow)
        for name, extra in [
            ("ddp", ("parallelism=ddp", *TWO)),
            ("zero1", ("parallelism=zero1", *TWO)),
            ("zero3", ("parallelism=zero3", *TWO)),
            ("fsdp", ("parallelism=fsdp", *TWO)),
            ("tp", ("parallelism=single", "parallelism.tp_size=2", *TWO)),
            ("pp", ("parallelism=single", "parallelism.pp_size=2", *TWO)),
            ("moe-ddp", ("parallelism=ddp", *MOE, *TWO)),
            ("moe-zero2", ("parallelism=zero2", *MOE, *TWO)),
            ("moe-fsdp", ("parallelism=fsdp", *MOE, *TWO)),
        ]
    ),
]


@pytest.mark.parametrize("extra", ADAMW_CASES)
@pytest.mark.slow
def test_adamw_steps_read_nothing_on_the_host(tmp_path, text_corpus, cache_dir, monkeypatch, extra):
    """Also: every strategy builds torch's fused AdamW, ZeRO's flat pieces and FSDP's and
    tensor parallel's DTensors included."""
    ranks = _host_reads(tmp_path, text_corpus, cache_dir, monkeypatch, *extra)
    assert _reads(ranks) == [0] * len(ranks), ranks
    assert all(rank["fused"] and all(rank["fused"]) for rank in ranks), ranks


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "ranks"), [("ddp", 2), pytest.param("zero2", 4, id="zero2-edp2")]
)
def test_expert_parallel_reads_nothing_on_the_host(
    tmp_path, text_corpus, cache_dir, monkeypatch, strategy, ranks
):
    """ep=2 with the grouped kernel: the padded exchange's split sizes are fixed blocks and
    its regrouping runs on the device, and the expert gradients' edp buckets (edp 2 on 4
    ranks) read nothing either: no host read on the step, per layer or per step."""
    ranks = _host_reads(
        tmp_path, text_corpus, cache_dir, monkeypatch,
        f"parallelism={strategy}", "parallelism.ep_size=2", *MOE,
        f"launcher.nproc_per_node={ranks}", f"train.micro_batch_size={4 // ranks}",
    )  # fmt: skip
    assert _reads(ranks) == [0] * len(ranks), ranks


@pytest.mark.slow
def test_expert_parallel_with_the_loop_kernel_reads_once_per_layer(
    tmp_path, text_corpus, cache_dir, monkeypatch
):
    """The loop kernel reads its experts' counts on the host; the exact exchange reads its
    split sizes in the same read: one per MoE layer and micro-batch, in the exchange."""
    ranks = _host_reads(
        tmp_path, text_corpus, cache_dir, monkeypatch,
        "parallelism=ddp", "parallelism.ep_size=2", "model=moe-tiny", "model.moe.kernel=loop",
        *TWO,
    )  # fmt: skip
    layers = MODEL_SHAPES["moe-tiny"].n_layers
    for rank in ranks:
        for rows in rank["reads"].values():
            assert all("llm/parallel/experts/exchange.py" in row["where"] for row in rows), rows
            assert sum(row["count"] for row in rows) == layers, rows


OTHERS = ["sgd", "lion", "lamb", "adafactor", "muon", "sophia"]


@pytest.mark.parametrize(
    "extra",
    [
        *(pytest.param((f"optimizer={name}",), id=name) for name in OTHERS),
        *(
            pytest.param((f"optimizer={name}", "parallelism=zero2", *TWO), id=f"{name}-zero2",
                         marks=pytest.mark.slow)
            for name in ("lamb", "adafactor", "lion")
        ),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_other_optimizers_read_at_most_the_skip_decision(
    tmp_path, text_corpus, cache_dir, monkeypatch, extra
):
    """At most one read, the overflow check's; Sophia's counted steps take no Hessian pass
    (optimizer.hessian_every=10), which reads more (its labels' keys and its own check)."""
    ranks = _host_reads(
        tmp_path, text_corpus, cache_dir, monkeypatch, *extra, "optimizer.hessian_every=10"
    )
    for rank in ranks:
        for rows in rank["reads"].values():
            assert sum(row["count"] for row in rows) <= 1, rows
            assert all(row["where"].startswith("llm/parallel/step.py") for row in rows), rows


def _fp32_single() -> SingleStrategy:
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    strategy = SingleStrategy(
        ParallelismConfig(),
        ParallelDims.from_config(1, 1, 1, 1),
        resolve_precision("fp32", cpu),
        cpu,
        disabled_loss_scaler(max_overflows_at_min_scale=3),
    )
    model = strategy.wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    strategy.build_optimizer(model, OptimizerConfig(lr=0.1))
    return strategy


def _step(strategy: SingleStrategy, bad: float | None = None):
    strategy.zero_grad()
    strategy.backward(strategy.model(torch.ones(3, 4)).square().mean())
    if bad is not None:
        strategy.model[2].weight.grad.view(-1)[0] = bad
    return strategy.clip_and_step(max_norm=1.0)


def _snapshot(strategy: SingleStrategy) -> dict[str, torch.Tensor]:
    tensors = {f"param {n}": p for n, p in strategy.model.named_parameters()}
    for i, state in enumerate(strategy.optimizer.state.values()):
        tensors.update({f"state {i} {k}": v for k, v in state.items()})
    return {k: v.detach().clone() for k, v in tensors.items()}


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fused_adamw_skips_a_nonfinite_step_on_the_device(bad):
    """The kernel leaves weights, moments and step counters as they were, bit for bit;
    ``skipped`` is a tensor, counted once read (``settle_skip``)."""
    strategy = _fp32_single()
    assert all(g["fused"] for g in strategy.optimizer.param_groups)
    first = _step(strategy)
    assert isinstance(first.skipped, torch.Tensor) and not first.skipped
    before = _snapshot(strategy)
    result = _step(strategy, bad)
    assert isinstance(result.skipped, torch.Tensor) and result.skipped
    assert not hasattr(strategy.optimizer, "found_inf")  # no stale flag for a later step()
    after = _snapshot(strategy)
    assert after.keys() == before.keys() and any(k.endswith(" step") for k in after)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    settle_skip(strategy.scaler, bool(result.skipped), step=2)
    assert strategy.scaler.skipped_steps == 1
    assert not _step(strategy).skipped  # and training goes on
    assert all(s["step"].item() == 2 for s in strategy.optimizer.state.values())


def test_nonfinite_steps_skipped_on_the_device_stop_the_run_when_read():
    strategy = _fp32_single()
    for step in (1, 2):
        settle_skip(strategy.scaler, bool(_step(strategy, float("nan")).skipped), step)
    with pytest.raises(TrainingError, match="not finite 3 steps in a row, the last at step 3"):
        settle_skip(strategy.scaler, bool(_step(strategy, float("nan")).skipped), 3)


def test_a_run_skips_exactly_the_step_whose_gradients_are_not_finite(
    tmp_path, text_corpus, cache_dir, monkeypatch
):
    """A NaN gradient at step 3 of 5, none of steps 2-4 logged: the run skips that step and
    no other (the skip is read at step 5), and AdamW's step counters say 4 steps."""
    clip_and_step, seen = SingleStrategy.clip_and_step, []

    def poisoned(self, max_norm):
        seen.append(self)
        if len(seen) == 3:
            next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = float(
                "nan"
            )
        return clip_and_step(self, max_norm)

    monkeypatch.setattr(SingleStrategy, "clip_and_step", poisoned)
    summary, _ = run(
        tmp_path, "nan", text_corpus, cache_dir, "train.max_steps=5", "train.log_every=100"
    )
    assert summary["skipped_steps"] == 1
    counters = {s["step"].item() for s in seen[-1].optimizer.state.values()}
    assert counters == {4.0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("extra", [(), MOE])
def test_no_step_synchronises_the_gpu(tmp_path, text_corpus, cache_dir, extra):
    """On the GPU, any synchronising call on a step that is neither logged nor a probe
    raises (torch.cuda.set_sync_debug_mode("error")); the run completes."""
    from llm.launch.launcher import launch
    from llm.train.trainer import Trainer

    train_step = Trainer.train_step

    def strict_step(self, timer, stop):
        step = self.state.step + 1
        if self.probes.logs(step) or self.probes.probes(step):
            return train_step(self, timer, stop)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train_step(self, timer, stop)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    overrides = small_run_overrides(tmp_path, text_corpus, cache_dir, *extra)
    overrides = [o for o in overrides if o != "train.device=cpu"]
    cfg = compose_config([*overrides, f"train.max_steps={STEPS}", "train.log_every=100"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "train_step", strict_step)
        summary = launch(cfg)
    assert summary["steps"] == STEPS
