"""benchmarks/optimizers.py on a tiny shape: the named rows are in the table, and each row's
state bytes per parameter are what the optimizer's own state tensors hold after a step,
counted here on a model built apart from the script's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llm.config import OptimizerConfig
from llm.memory import optimizer_state_tensors, storage_bytes
from llm.models import build_model, materialize, model_args
from llm.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import optimizers as bench

ROWS = ["adamw", "lion", "adafactor", "lion (lion-pytorch)", "adafactor (torch)"]


def _state_bytes_per_param(name: str) -> float:
    model = materialize(build_model(model_args("gpt2-tiny")), "cpu", seed=0)
    opt = build_optimizer(model, OptimizerConfig(name=name))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    n_params = sum(p.numel() for p in model.parameters())
    return storage_bytes(optimizer_state_tensors(opt)) / n_params


def test_optimizers_benchmark_tiny(monkeypatch, capsys):
    argv = ["optimizers.py", "--model", "gpt2-tiny", "--seq", "16", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rows", ",".join(ROWS)])
    bench.main()
    table = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| optimizer")
    }
    assert list(table) == ROWS
    for name in ("adamw", "lion", "adafactor"):
        assert float(table[name][2]) == round(_state_bytes_per_param(name), 2)
    assert float(table["lion (lion-pytorch)"][2]) == float(table["lion"][2])
    assert float(table["adafactor (torch)"][2]) == float(table["adafactor"][2])
