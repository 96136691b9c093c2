"""The estimate's ``cublas_workspaces`` row (llm.estimate.workspaces): torch's sizes, the
row in every moment of a GPU estimate and none on CPU, and on a GPU the allocator's bytes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_pass.estimator import compose_config, held_by_one_matmul
from llm.build import model_args_for
from llm.estimate.estimator import estimate
from llm.estimate.workspaces import training_workspaces, workspace_bytes

MIB = 2**20


def test_workspace_sizes_follow_torch_defaults_and_the_environment_variable():
    assert workspace_bytes(9, None) == 32 * MIB  # Hopper
    assert workspace_bytes(10, None) == 32 * MIB  # Blackwell
    assert workspace_bytes(8, None) == 8 * MIB + 128 * 1024  # :4096:2:16:8, Ampere
    assert workspace_bytes(9, ":4096:2") == 8 * MIB
    assert workspace_bytes(8, ":4096:8:16:8") == 32 * MIB + 128 * 1024
    assert workspace_bytes(9, "nonsense") == 32 * MIB  # torch warns and takes its default


def test_training_holds_two_workspaces_on_a_named_gpu_and_none_on_cpu(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert training_workspaces("cpu") == 0
    assert training_workspaces("h200") == 2 * 32 * MIB
    assert training_workspaces("a100") == 2 * (8 * MIB + 128 * 1024)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert training_workspaces("h100") == 2 * 16 * 8 * 1024


def _estimate(*extra):
    base = ["logger=none", "output_dir=unused", "model=gpt2-tiny", "precision=bf16"]
    cfg = compose_config([*base, *extra])
    return estimate(cfg, model_args_for(cfg, vocab_size=cfg.data.vocab_size))


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["parallelism=zero3"],
        ["parallelism=ddp", "parallelism.pp_size=2", "estimate.gpus_per_node=2"],
    ],
)
def test_a_gpu_estimate_holds_the_workspaces_at_every_moment_and_a_cpu_one_none(layout):
    gpu = _estimate("estimate.device=h200", *layout)
    held = training_workspaces("h200")
    for name, rows in gpu.moments.items():
        assert rows["cublas_workspaces"] == held, name
    for stage in gpu.stages or []:
        assert stage.device["cublas_workspaces"] == held
    assert gpu.total == sum(gpu.peak_rows.values())
    cpu = _estimate("estimate.device=cpu", *layout)
    assert all("cublas_workspaces" not in rows for rows in cpu.moments.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_allocator_holds_what_the_row_says_after_a_matmuls_forward_and_backward():
    """One matmul forward (this thread) and backward (autograd's device thread): what is
    allocated beyond the tensors is the two workspaces."""
    assert held_by_one_matmul() == training_workspaces("cuda")
