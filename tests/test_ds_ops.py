"""DeepSpeed's first run says it is compiling ops before the silent minutes start
(llm/parallel/ds_ops.py), and only when the op is not built yet."""

from __future__ import annotations

import logging

import pytest
import torch

from llm.parallel.ds_ops import SHM_COMM, announce_builds, not_built, optimizer_ops, swap_ops

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "ds_config, device, ops",
    [
        ({}, GPU, []),  # a client optimizer
        ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, GPU, []),
        ({"optimizer": {"type": "AdamW", "params": {}}}, GPU, ["fused_adam"]),
        ({"optimizer": {"type": "Adam", "params": {}}}, CPU, []),
        (
            {
                "optimizer": {"type": "AdamW", "params": {"torch_adam": False}},
                "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
            },
            CPU,
            ["cpu_adam"],
        ),
        (
            {
                "optimizer": {"type": "AdamW", "params": {"torch_adam": False}},
                "zero_optimization": {"offload_optimizer": {"device": "nvme"}},
            },
            CPU,
            ["cpu_adam"],
        ),
        ({"optimizer": {"type": "Lamb", "params": {}}}, GPU, ["fused_lamb"]),
        ({"optimizer": {"type": "Muon", "params": {}}}, GPU, []),
    ],
)
def test_the_ops_a_config_builds(ds_config, device, ops):
    assert optimizer_ops(ds_config, device) == ops


@pytest.mark.parametrize(
    "zero, ops",
    [
        ({}, []),
        ({"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, []),
        ({"offload_optimizer": {"device": "nvme"}}, ["async_io"]),
        (
            {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
            ["async_io"],
        ),
    ],
)
def test_an_nvme_offload_builds_the_swappers_op(zero, ops):
    assert swap_ops({"zero_optimization": zero}) == ops


def test_said_before_a_build_and_not_once_built(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="llm.parallel.ds_ops"):
        announce_builds(["cpu_adam", SHM_COMM], tmp_path)
    (record,) = caplog.records
    assert record.getMessage() == (
        f"DeepSpeed compiles its cpu_adam and {SHM_COMM} ops now, on first use: several "
        f"minutes with no output, once (cached in {tmp_path})"
    )
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert not_built(["cpu_adam", SHM_COMM], tmp_path) == [SHM_COMM]
    (tmp_path / SHM_COMM).mkdir()
    (tmp_path / SHM_COMM / f"{SHM_COMM}.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm.parallel.ds_ops"):
        announce_builds(["cpu_adam", SHM_COMM], tmp_path)
    assert not caplog.records
