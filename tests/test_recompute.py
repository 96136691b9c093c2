"""Activation recompute: same gradients, fewer saved bytes, safe on the meta device."""

import pytest
import torch
from torch import nn

from llm.config import RecomputeConfig
from llm.errors import ConfigError
from llm.memory import ActivationMemoryCounter
from llm.recompute import apply_recompute

D, N_LAYERS = 16, 4


class Block(nn.Module):
    """A pre-norm MLP block with dropout, (B, T, D) -> (B, T, D)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(D) for _ in range(N_LAYERS))
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.out(x).square().mean()


def _model(name: str, every: int = 1) -> Stack:
    torch.manual_seed(0)
    return apply_recompute(Stack(), RecomputeConfig(name=name, every=every))


def _grads(model: Stack, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # the same dropout masks for every policy
    model(x).backward()
    return {k: p.grad for k, p in zip(model.state_dict(), model.parameters(), strict=True)}


def _saved_bytes(model: Stack, x: torch.Tensor) -> int:
    with ActivationMemoryCounter() as counter:
        loss = model(x)
    loss.backward()
    return counter.bytes


def test_full_recompute_gives_the_same_gradients():
    x = torch.randn(2, 8, D, requires_grad=True)
    reference = _grads(_model("none"), x)
    for every in (1, 2):
        grads = _grads(_model("full", every), x)
        assert grads.keys() == reference.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=0, atol=1e-6, msg=name)


def test_full_recompute_saves_fewer_bytes_and_every_2_is_in_between():
    x = torch.randn(4, 32, D)
    none, half, full = (
        _saved_bytes(_model("none"), x),
        _saved_bytes(_model("full", 2), x),
        _saved_bytes(_model("full", 1), x),
    )
    assert full < half < none
    # Full keeps exactly each block's (B, T, D) fp32 input, plus what the head saves: its
    # input (the last block's output), its (1, D) weight and the (B, T, 1) input of square().
    block_input = 4 * 32 * D * 4
    assert full == N_LAYERS * block_input + block_input + D * 4 + 4 * 32 * 4


def test_every_k_wraps_the_kth_blocks_and_keeps_state_dict_names():
    plain = _model("none")
    wrapped = _model("full", every=2)
    kinds = [type(b).__name__ for b in wrapped.layers]
    assert kinds == ["Block", "CheckpointWrapper", "Block", "CheckpointWrapper"]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    assert wrapped.layers[1].up is wrapped.layers[1]._checkpoint_wrapped_module.up


def test_applies_on_the_meta_device_and_materialises():
    with torch.device("meta"):
        model = Stack()
    apply_recompute(model, RecomputeConfig(name="full"))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    model(torch.randn(2, 4, D)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_full_recompute_needs_layers():
    with pytest.raises(ConfigError, match=r"recompute=full needs a model with \.layers"):
        apply_recompute(nn.Linear(2, 2), RecomputeConfig(name="full"))
