"""Activation recompute: same losses and gradients as keeping everything, fewer saved bytes
(counted exactly, per layer, and matching the live storages), safe on the meta device, and
refusals of impossible settings in one line."""

import pytest
import torch
import torch.nn.functional as F
from helpers import read_metrics, run
from torch import nn

from llm.config import RecomputeConfig
from llm.errors import ConfigError
from llm.memory import ActivationMemoryCounter, PeakTracker, find_layers, module_state_tensors
from llm.models import build_model, materialize, model_args
from llm.recompute import apply_recompute, recompute_policy

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
    for policy in ("full", "op_sac"):
        with pytest.raises(ConfigError, match=rf"recompute={policy} needs a model with \.layers"):
            apply_recompute(nn.Linear(2, 2), RecomputeConfig(name=policy))
    with pytest.raises(ConfigError, match="recompute=selective needs attention modules"):
        apply_recompute(nn.Linear(2, 2), RecomputeConfig(name="selective"))


# ---- the policies on the real models ------------------------------------------------------
# fp32, dropout 0.1 (in attention and the residual paths): every policy reruns the same ops
# on the same inputs with the RNG state restored, so losses and gradients equal recompute=
# none's up to the summation order of recomputed ops; measured: bit-identical on CPU.
PARITY_TOL = {"rtol": 0, "atol": 1e-6}
POLICIES = [
    pytest.param("full", {}, id="full"),
    pytest.param("selective", {}, id="selective"),
    pytest.param("op_sac", {}, id="op_sac"),
    pytest.param("op_sac", {"save_every_other_mm": True}, id="op_sac-every-other-mm"),
]
B, T = 2, 32
INFIX = "_checkpoint_wrapped_module."  # the wrapper's infix in named_parameters


def _tiny(family: str, backend: str, policy: str, dropout: float = 0.1, **options) -> nn.Module:
    args = model_args(family, dropout=dropout)
    model = build_model(args, backend)  # on the meta device, as llm.run applies policies
    apply_recompute(model, RecomputeConfig(name=policy, **options))
    return materialize(model, "cpu", 0).train()


def _loss_and_grads(model: nn.Module, layers: bool = True):
    ids = torch.randint(
        0, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)
    ).to(next(model.parameters()).device)
    torch.manual_seed(7)  # the same dropout masks for every policy
    with ActivationMemoryCounter(find_layers(model) if layers else None) as counter:
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    grads = {n.replace(INFIX, ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counter


@pytest.mark.parametrize("family", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("policy", "options"), POLICIES)
def test_policies_give_the_losses_and_gradients_of_none(family, backend, policy, options):
    ref_loss, ref_grads, ref_count = _loss_and_grads(_tiny(family, backend, "none"))
    loss, grads, count = _loss_and_grads(_tiny(family, backend, policy, **options))
    torch.testing.assert_close(loss, ref_loss, **PARITY_TOL)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **PARITY_TOL, msg=name)
    # Every policy keeps less in each block than none, and the same outside the blocks.
    assert count.by_layer["outside"] == ref_count.by_layer["outside"]
    for name, n in count.by_layer.items():
        if name != "outside":
            assert 0 < n < ref_count.by_layer[name], (name, n)


@pytest.mark.parametrize(("policy", "options"), [pytest.param("none", {}, id="none"), *POLICIES])
def test_counted_activations_are_what_the_forward_leaves_alive(policy, options):
    """The allocator-level truth: the live storages the peak tracker sees at the end of the
    forward minus at its start are exactly the counted activations plus the loss. Under
    op_sac most of them are SAC's cache, which no saved-tensor hook sees; the tracker must
    class them as activations too, and release them with the backward."""
    model = _tiny("llama-tiny", "eager", policy, **options)
    ids = torch.randint(
        0, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)
    )
    tracker = PeakTracker(torch.device("cpu"), "alternate")
    tracker.watch(lambda: {"params": module_state_tensors(model)["params"]})
    with tracker.step(tracked=True):
        before = tracker.current
        with ActivationMemoryCounter(find_layers(model)) as counter:
            loss = model(ids).logsumexp(-1).mean()
        alive = tracker.current - before - loss.untyped_storage().nbytes()
        kept = tracker.totals["activations"]
        tracker.phase("backward")
        loss.backward()
        after_backward = tracker.totals["activations"]
    assert counter.activation_bytes == alive == kept > 0
    assert sum(counter.by_layer.values()) == counter.activation_bytes
    assert after_backward == 0


def test_per_layer_bytes_sum_to_the_total_and_layers_are_alike():
    model = _tiny("gpt2-tiny", "sdpa", "none")
    _, _, counter = _loss_and_grads(model)
    layers = [n for name, n in counter.by_layer.items() if name != "outside"]
    assert len(layers) == model.args.n_layers and len(set(layers)) == 1
    assert sum(layers) + counter.by_layer["outside"] == counter.activation_bytes
    # Parameters (and the views of them matmuls save) are not activations.
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert 0 < counter.bytes - counter.activation_bytes <= params


def test_selective_with_a_flash_kernel_drops_only_the_logsumexp():
    """sdpa on CPU without dropout runs the flash kernel, which keeps O(T): q, k, v (kept by
    selective too), its output and the log-sum-exp (B, H, T) fp32. The output is a
    transposed view of a (B, T, H, D) tensor, so the output projection's input (the
    (B, T, d) reshape, a view) is the same storage and stays kept: selective frees only
    the log-sum-exp, and pays one more kernel forward in backward."""
    args = model_args("gpt2-tiny")  # dropout 0: the flash kernel
    kept = {}
    for policy in ("none", "selective"):
        model = materialize(
            apply_recompute(build_model(args, "sdpa"), RecomputeConfig(name=policy)), "cpu", 0
        )
        kept[policy] = _loss_and_grads(model)[2].by_layer
    for layer in range(args.n_layers):
        name = f"layers.{layer}"
        assert kept["none"][name] - kept["selective"][name] == B * args.n_heads * T * 4
    # Why the output's storage stays kept: q, k, v come as (B, T, H, D) transposed (the
    # projections' layout), and the kernel writes its output in the same layout.
    q = torch.randn(B, T, args.n_heads, args.head_dim, requires_grad=True).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.transpose(1, 2).is_contiguous()


def test_save_every_other_mm_keeps_less_than_op_sac():
    every = _loss_and_grads(_tiny("llama-tiny", "eager", "op_sac"))[2]
    other = _loss_and_grads(_tiny("llama-tiny", "eager", "op_sac", save_every_other_mm=True))[2]
    assert other.by_layer["layers.0"] < every.by_layer["layers.0"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "partial"}, "recompute.name='partial' is unknown"),
        ({"name": "full", "every": 0}, "recompute.every=0 must be > 0"),
        (
            {"name": "budget", "memory_budget": 1.5},
            r"recompute.memory_budget=1.5 must be in \[0, 1\]",
        ),
        ({"name": "budget", "memory_budget": -0.1}, "must be in"),
        ({"name": "full", "save_every_other_mm": True}, "applies to recompute=op_sac only"),
    ],
)
def test_bad_recompute_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as exc:
        RecomputeConfig(**overrides)
    assert "\n" not in str(exc.value)


def test_budget_sets_the_partitioner_budget_only_around_the_forward():
    knob = torch._functorch.config
    default = knob.activation_memory_budget
    with recompute_policy(RecomputeConfig(name="budget", memory_budget=0.25)).forward_context():
        assert knob.activation_memory_budget == 0.25
    assert knob.activation_memory_budget == default


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_budget_under_compile_gives_the_gradients_of_none(budget):
    """torch.compile on CPU (minutes) with the partitioner's budget, against the eager model
    without recompute. Dropout 0: inductor draws its masks with its own RNG. Tolerance
    1e-5: inductor fuses and reorders fp32 arithmetic."""
    ref_loss, ref_grads, _ = _loss_and_grads(_tiny("gpt2-tiny", "sdpa", "none", dropout=0.0))
    model = _tiny("gpt2-tiny", "sdpa", "none", dropout=0.0)
    compiled = torch.compile(model)
    policy = recompute_policy(RecomputeConfig(name="budget", memory_budget=budget))
    ids = torch.randint(
        0, model.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)
    )
    with policy.forward_context():
        loss = F.cross_entropy(compiled(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("policy", "options"), POLICIES)
def test_policies_with_flex_attention_give_the_gradients_of_none(policy, options):
    """On CUDA: FlexAttention has no backward on CPU in torch 2.13 (llm/attention/flex.py
    refuses training there); no dropout in it."""

    def grads(name, **kw):
        model = materialize(
            apply_recompute(
                build_model(model_args("llama-tiny"), "flex"), RecomputeConfig(name=name, **kw)
            ),
            "cuda",
            0,
        )
        return _loss_and_grads(model)

    ref_loss, ref_grads, _ = grads("none")
    loss, got, _ = grads(policy, **options)
    torch.testing.assert_close(loss, ref_loss, **PARITY_TOL)
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], **PARITY_TOL, msg=name)


def test_train_py_reports_activation_bytes(tmp_path, text_corpus, cache_dir):
    """recompute=selective end to end; the activation keys in metrics.jsonl (probe steps:
    1 and 3, step 2 follows a probe and is timed) and summary.json (the last probe), per-layer
    plus outside equal to the total."""
    summary, out = run(
        tmp_path,
        "selective",
        text_corpus,
        cache_dir,
        "recompute=selective",
        "train.max_steps=3",
        "train.log_every=2",
        "train.micro_batch_size=2",
    )
    rows = [m for m in read_metrics(out) if "loss" in m and m["probe"]]
    assert [m["step"] for m in rows] == [1, 3]
    for m in [*rows, summary]:
        per_layer = m["activation_bytes_per_layer"]
        assert len(per_layer) == 2 and min(per_layer) > 0  # gpt2-tiny's two blocks
        assert sum(per_layer) + m["activation_bytes_outside_layers"] == m["activation_bytes"]
    assert summary["activation_bytes"] == rows[-1]["activation_bytes"]
