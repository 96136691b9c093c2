"""The CUDA path (`make test-gpu` on a machine with a GPU; CI has none and deselects these)."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config, small_run_overrides

from llm.launch.launcher import launch
from llm.precision import resolve_precision

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_auto_precision_is_bf16_where_supported():
    policy = resolve_precision("auto", torch.device("cuda"))
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert policy.compute_dtype == expected and policy.param_dtype == torch.float32


@pytest.mark.parametrize("parallelism", ["single", "ddp"])
def test_default_device_is_the_gpu(tmp_path, text_corpus, cache_dir, parallelism):
    overrides = small_run_overrides(tmp_path, text_corpus, cache_dir, f"parallelism={parallelism}")
    overrides = [o for o in overrides if o != "train.device=cpu"]  # auto picks CUDA
    summary = launch(compose_config(overrides))
    assert summary["device"] == "cuda" and summary["hardware"]["gpu"]
    assert summary["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    # The CUDA allocator's peak covers at least the model state.
    state = summary["model_state_bytes"][0]
    assert summary["peak_memory_bytes"] >= state["params"] + state["grads"]
    # MFU is reported for GPUs in the peak table (null for unknown ones), and is a fraction.
    assert summary["mfu"] is None or 0 < summary["mfu"] < 1


def test_offload_keeps_activations_off_the_gpu_with_the_same_losses(
    tmp_path, text_corpus, cache_dir
):
    """recompute=offload: the saved activations live in pinned host memory, so the step's
    CUDA peak is lower than without, and the losses are the same (the same kernels on the
    same values; only where the saved tensors wait differs)."""

    def launch_with(policy: str) -> dict:
        overrides = small_run_overrides(
            tmp_path / policy,
            text_corpus,
            cache_dir,
            f"recompute={policy}",
            "model=llama-tiny",
            "precision=fp32",
            "train.micro_batch_size=16",
            "train.max_steps=3",
        )
        overrides = [o for o in overrides if o != "train.device=cpu"]
        return launch(compose_config(overrides))

    plain, offloaded = launch_with("none"), launch_with("offload")
    assert offloaded["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-6)
    assert offloaded["peak_memory_bytes"] < plain["peak_memory_bytes"]
