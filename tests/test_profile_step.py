"""python -m benchmarks.profile_step: the op-category rules, the host-read counter, the GPU
split on made-up kernels, and one profiled run of the tiny test setup."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config, one_line, small_run_overrides

from benchmarks.profile_step import profile_step
from benchmarks.profile_step import run as run_module
from benchmarks.profile_step.analyse import gpu_times, launch_links, split
from benchmarks.profile_step.host_reads import READS, HostReads
from benchmarks.profile_step.rules import categorise
from benchmarks.profile_step.run import Plan, refuse_multi_rank
from llm.errors import ConfigError
from llm.train.trainer import Trainer

HERE = "tests/test_profile_step.py"

# (an op's name, then those enclosing it) -> its category.
CASES = [
    (["aten::mm", "backward"], "matmul"),
    (["aten::addmm", "aten::linear", "forward"], "matmul"),
    (["aten::t", "aten::linear", "forward"], "matmul"),
    (["aten::bmm"], "matmul"),
    (["sm90_xmma_gemm_bf16bf16_bf16f32", "aten::mm"], "matmul"),
    (
        ["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention"],
        "attention",
    ),
    (["aten::_efficient_attention_backward"], "attention"),
    (["flash_fwd_kernel", "aten::empty"], "attention"),
    (["aten::_log_softmax", "aten::log_softmax", "aten::cross_entropy_loss", "loss"], "loss"),
    (
        [
            "aten::_log_softmax_backward_data",
            "autograd::engine::evaluate_function: LogSoftmaxBackward0",
        ],
        "loss",
    ),
    (["aten::nll_loss_backward"], "loss"),
    (["aten::mul", "_ChunkedLinearCrossEntropyBackward"], "loss"),  # train.fused_loss
    (["aten::copy_", "aten::_to_copy", "loss"], "loss"),
    (["aten::_foreach_mul_"], "optimizer"),
    (["aten::_fused_adamw_"], "optimizer"),
    (["aten::lerp_", "Optimizer.step#AdamW.step", "optimizer"], "optimizer"),
    (["aten::mm", "optimizer"], "optimizer"),
    (["c10d::allreduce_", "optimizer"], "communication"),
    (["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "c10d::allreduce_"], "communication"),
    (["gloo:all_reduce"], "communication"),
    (["aten::_reduce_scatter_base"], "communication"),
    (["aten::gelu"], "elementwise"),
    (["aten::native_layer_norm", "aten::layer_norm"], "elementwise"),
    (["aten::add_"], "elementwise"),
    (["void at::native::vectorized_elementwise_kernel<4>", "aten::mul"], "elementwise"),
    (["triton_poi_fused_add_0"], "elementwise"),
    (["aten::embedding"], "other ops"),
    (["aten::index_select", "data"], "data"),
]


@pytest.mark.parametrize(("names", "category"), CASES)
def test_op_category_rules(names, category):
    assert categorise(names, is_op=True) == category


def test_host_time_that_runs_no_op_is_its_scopes_or_other_host_time():
    assert categorise(["autograd::engine::evaluate_function: MmBackward0"], False) == (
        "other host time"
    )
    assert categorise(["Optimizer.step#AdamW.step", "optimizer"], False) == "optimizer"
    assert categorise(["data", "step"], False) == "data"


def test_every_read_reaches_the_counter_on_cpu():
    t = torch.tensor(1.5)
    with HostReads() as reads:
        line = inspect.currentframe().f_lineno + 1
        t.item(), t.tolist(), bool(t), float(t), int(t), t.cpu()
    rows = {r["what"]: r for r in reads.rows(steps=1)}
    assert set(rows) == set(READS)  # cpu() of a CPU tensor waits for nothing
    for row in rows.values():
        assert (row["where"], row["count"], row["tensor_on"]) == (f"{HERE}:{line}", 1, "cpu")


def _event(name, start, end, *, parent=None, cuda=False, linked=0, ident=0):
    """A FunctionEvent as torch 2.11 makes it (no linked_correlation_id), and its raw
    kineto event, which holds the link."""
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    raw = SimpleNamespace(
        device_type=lambda: device,
        correlation_id=lambda: ident,
        linked_correlation_id=lambda: linked,
        name=lambda: name,
    )
    return raw, SimpleNamespace(
        name=name,
        id=ident,
        cpu_parent=parent,
        is_user_annotation=name in ("forward", "optimizer"),
        device_type=device,
        time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start),
    )


def test_gpu_split_shares_overlap_and_leaves_the_rest_idle():
    forward = _event("forward", 0, 100, ident=1)
    mm = _event("aten::mm", 0, 10, parent=forward[1], ident=7)
    step = _event("Optimizer.step#AdamW.step", 50, 90, ident=8)
    # The runtime's launch call shares the optimizer step's id (another id space) but is
    # linked to an op: it is not taken for the op that launched a kernel.
    launch = _event("cudaLaunchKernel", 60, 61, ident=7, linked=8)
    raw, events = zip(
        forward,
        mm,
        step,
        launch,
        _event("sm90_gemm", 0, 400, cuda=True, linked=7, ident=101),
        _event("ncclDevKernel_AllReduce", 200, 600, cuda=True, linked=9, ident=102),
        _event("multi_tensor_apply_kernel", 700, 800, cuda=True, linked=8, ident=103),
        # torch 2.11 lists a scope's span on the device as a CUDA event: not a kernel.
        _event("forward", 0, 900, cuda=True, ident=104),
        strict=True,
    )
    by_kernel, by_category = gpu_times(list(events), launch_links(raw))
    assert by_kernel["sm90_gemm"] == pytest.approx(400e-6)
    # 200..400 us both run: each takes half of it.
    assert by_category == pytest.approx(
        {"matmul": 300e-6, "communication": 300e-6, "optimizer": 100e-6}
    )
    rows = {r["category"]: r["seconds"] for r in split(by_category, 1000e-6, on_gpu=True)}
    assert rows["idle"] == pytest.approx(300e-6)
    assert sum(rows.values()) == pytest.approx(1000e-6)


def test_more_than_one_rank_is_refused_in_one_line():
    cfg = compose_config(["output_dir=unused", "launcher.nproc_per_node=2"])
    with pytest.raises(ConfigError) as exc:
        refuse_multi_rank(cfg)
    assert "nproc_per_node=1" in one_line(exc)


def _planted_step(original):
    """Trainer.train_step with one .item() of its own per step."""

    def train_step(self, timer, stop):
        torch.ones(()).item()
        return original(self, timer, stop)

    return train_step


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("profile_step")
    overrides = small_run_overrides(tmp / "unused", text_corpus, cache_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "train_step", _planted_step(Trainer.train_step))
        out, text = profile_step(overrides, tmp / "out", warmup=1, steps=2)
    return out, text, json.loads((out / "profile.json").read_text())


def test_profile_writes_its_files(profiled):
    out, text, figures = profiled
    for name in ("report.md", "profile.json", "trace.json", "key_averages.txt"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert "under the profiler" in text and "tokens/s" not in text
    assert figures["profiled_steps"] == [2, 3] and figures["counted_steps"] == [4, 5]
    kinds = figures["step_kinds"].values()
    assert not any(k["probe"] or k["logged"] for k in kinds)


def test_top_ops_shares(profiled):
    top = profiled[2]["top"]
    assert 0 < len(top) <= 20
    assert all(0 < row["share"] <= 1 for row in top)
    assert sum(row["share"] for row in top) <= 1


def test_categories_sum_to_the_profiled_time(profiled):
    figures = profiled[2]
    seconds = {r["category"]: r["seconds"] for r in figures["categories"]}
    assert sum(seconds.values()) == pytest.approx(figures["profiled_wall_s"], rel=0.01)
    assert all(s >= 0 for s in seconds.values())
    assert seconds["matmul"] > 0 and seconds["optimizer"] > 0


def test_host_reads_find_the_planted_item(profiled):
    reads = profiled[2]["host_reads"]
    source, first = inspect.getsourcelines(_planted_step)
    line = first + next(i for i, text in enumerate(source) if "ones(()).item()" in text)
    planted = [r for r in reads if r["where"] == f"{HERE}:{line}"]
    assert [(r["what"], r["per_step"]) for r in planted] == [("item", 1)]
    # What the default single-process path reads today (another change removes them).
    for r in reads:
        if r not in planted:
            print(
                f"host read: {r['where']} via {r['via'] or '-'}: {r['what']} x{r['per_step']:g}/step"
            )


def test_the_profile_runs_no_memory_probe_unless_asked():
    plan = Plan(warmup=1, steps=1)
    assert run_module.compose_config([], plan).train.memory_tracking == "off"
    asked = run_module.compose_config(["train.memory_tracking=logged", "logger=none"], plan)
    assert (asked.train.memory_tracking, asked.logger.name) == ("logged", "none")
