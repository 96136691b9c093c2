"""train.allocator_blocks (llm/memory/allocator_blocks.py): the CUDA allocator's record of a
tracked step replayed to its peak. The replay is checked on a made-up trace in torch's
format (the record itself needs a GPU: the GPU pass's estimator section takes it); off the
GPU the key is refused in one line."""

from __future__ import annotations

import pytest
import torch

from llm.errors import ConfigError
from llm.memory.allocator_blocks import blocks_at_peak, made_by
from llm.memory.peak import PeakTracker
from llm.validate import validate
from tests.helpers import compose_config, one_line

MIB = 2**20
LINEAR = {"filename": "/repo/llm/models/layers.py", "line": 40, "name": "forward"}
TORCH = {"filename": "/venv/torch/nn/functional.py", "line": 9, "name": "linear"}


def _alloc(addr: int, mib: int, frames=(TORCH, LINEAR)) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": list(frames),
            "stream": 0}  # fmt: skip


def _free(addr: int, mib: int, action: str = "free_completed") -> dict:
    return {"action": action, "addr": addr, "size": mib * MIB, "frames": [], "stream": 0}


def test_the_blocks_live_at_the_peak_largest_first():
    trace = [
        _alloc(1, 10),  # an activation, live at the peak
        _alloc(2, 32, frames=[TORCH]),  # a workspace: no frame in llm/
        _free(99, 40),  # a block from before the step (a gradient) freed: the total falls
        _alloc(3, 30),  # so this alloc is not yet the peak (10 + 32 - 40 + 30 = 32)
        _free(1, 10, "free_requested"),  # pending on a stream: still allocated
        _alloc(4, 50),  # the peak: 82 MiB above the step's start
        _free(4, 50),
        _free(1, 10),
        {"action": "segment_alloc", "addr": 5, "size": 200 * MIB, "frames": [], "stream": 0},
        _alloc(6, 45),  # 32 + 30 + 45 = 107 - 40 = 67: under the peak
    ]
    got = blocks_at_peak(trace, 3)
    assert [b["bytes"] // MIB for b in got] == [50, 32, 30]
    assert got[0]["made_by"] == "llm/models/layers.py:40 in forward"
    assert got[1]["made_by"] == "/venv/torch/nn/functional.py:9 in linear"
    assert blocks_at_peak([], 3) == []
    assert made_by([]) == "no frame recorded"


def test_allocator_blocks_need_a_gpu(tmp_path):
    cfg = compose_config([f"output_dir={tmp_path}", "train.device=cpu", "train.allocator_blocks=8"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert "train.allocator_blocks=8" in one_line(e) and "train.peak_tensors" in one_line(e)
    with pytest.raises(ConfigError, match="must be >= 0"):
        compose_config(["train.allocator_blocks=-1"])


def test_a_cpu_tracker_records_no_blocks():
    tracker = PeakTracker("cpu", "logged", tensors=0, blocks=8)
    assert tracker.blocks == 0 and tracker.best_step_blocks is None


def test_the_estimator_section_asks_for_blocks_on_the_gpu_and_notes_them(tmp_path, monkeypatch):
    from benchmarks.gpu_pass import estimator

    monkeypatch.setattr(estimator, "device", lambda dry: torch.device("cpu" if dry else "cuda"))
    gpu = estimator.overrides(tmp_path, "gpt2-small", 8, "none", 1024, dry=False)
    assert f"train.allocator_blocks={estimator.BLOCKS}" in gpu
    assert not any("allocator_blocks" in o for o in estimator.overrides(
        tmp_path, "gpt2-tiny", 2, "none", 64, dry=True))  # fmt: skip
    row = {"model": "gpt2-small", "recompute": "none", "allocator_blocks": {
        "1": {"bytes": 32 * MIB, "made_by": "torch/nn/functional.py:9 in linear", "stream": 0},
        "2": {"bytes": 12 * MIB, "made_by": "llm/models/layers.py:40 in forward", "stream": 0},
    }}  # fmt: skip
    assert estimator.blocks_note(row) == (
        "gpt2-small none: the allocator's largest blocks at the peak: 32.0 MiB "
        "torch/nn/functional.py:9 in linear; 12.0 MiB llm/models/layers.py:40 in forward"
    )
    assert estimator.blocks_note({**row, "allocator_blocks": None}) is None
