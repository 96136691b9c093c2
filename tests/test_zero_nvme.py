"""Our ZeRO's NVMe tier (parallelism.offload_optimizer=nvme, offload_params=nvme) against
the same strategy in memory on 2 gloo ranks: losses, final weights and optimizer states
equal bit for bit in fp32, across a resume too; and its files, faults and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run, train_losses

STEPS = ("train.max_steps=4", "parallelism.bucket_cap_mb=0.05", "launcher.nproc_per_node=2")


def checkpoint_tensors(out) -> dict[str, torch.Tensor]:
    """Every tensor of a run's last checkpoint (weights and optimizer moments), by key."""
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata()
    state = {
        k: torch.empty(v.size)
        for k, v in meta.state_dict_metadata.items()
        if hasattr(v, "size") and v.size
    }
    dcp.load(state, storage_reader=reader)
    return state


def assert_same_run(a, b) -> None:
    assert train_losses(a) == train_losses(b)
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys() and any(k.startswith("optimizer.state") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_equals_in_memory(tmp_path, text_corpus, cache_dir, stage):
    extra = (f"parallelism=zero{stage}", *STEPS)
    _, memory = run(tmp_path, "memory", text_corpus, cache_dir, *extra)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = [f"parallelism.nvme_path={nvme}", "parallelism.offload_optimizer=nvme"]
    if stage == 3:
        offload.append("parallelism.offload_params=nvme")
    summary, out = run(tmp_path, "offloaded", text_corpus, cache_dir, *extra, *offload)
    assert_same_run(memory, out)
    ranks = summary["offload"]
    assert [r["optimizer"]["steps"] for r in ranks] == [4, 4]
    assert list(nvme.iterdir()) == []  # the files went with the run
