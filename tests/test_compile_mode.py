"""train.compile_mode reaches torch.compile (the model's and the plain loss's), and is refused
without train.compile."""

from __future__ import annotations

import pytest

import llm.run
from llm.config import TrainConfig
from llm.errors import ConfigError
from tests.helpers import run


def test_compile_mode_reaches_torch_compile(tmp_path, text_corpus, cache_dir, monkeypatch):
    """The model and the plain loss, each compiled once in the mode asked for."""
    compiled = []

    def compile_(target, mode=None):
        compiled.append((getattr(target, "__name__", type(target).__name__), mode))
        return target

    monkeypatch.setattr(llm.run.torch, "compile", compile_)
    extra = ("train.max_steps=2", "train.compile=true", "train.compile_mode=max-autotune")
    run(tmp_path, "compiled", text_corpus, cache_dir, *extra)
    assert sorted(compiled) == [
        ("Transformer", "max-autotune"),
        ("_cross_entropy_sum", "max-autotune"),
    ]


def test_a_mode_without_compile_or_unknown_is_refused():
    with pytest.raises(ConfigError, match=r"add train\.compile=true"):
        TrainConfig(compile_mode="reduce-overhead")
    with pytest.raises(ConfigError, match="compile_mode"):
        TrainConfig(compile=True, compile_mode="fast")
