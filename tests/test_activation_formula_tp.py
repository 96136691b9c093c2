"""The activation formula under tensor parallel (tp=2), with and without sequence parallel,
against what one tensor-parallel rank's autograd really saves.

The rank runs in this process on torch's fake process group (conftest's ``fake_tp_mesh``):
the model is split exactly as a real run splits it (llm.parallel.tensor_parallel, DTensor),
its collectives return without communicating, so values are meaningless but every saved
tensor has the shape and dtype a real rank's has. Counted per block and outside the blocks
with llm.memory.ActivationMemoryCounter, parameters left out; equality is exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from llm.config import RecomputeConfig
from llm.estimate import layer_terms, outside_terms
from llm.memory import ActivationMemoryCounter
from llm.memory.storage import local_shard
from llm.models import build_model, model_args
from llm.models.weights import InitSource, materialize_from
from llm.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel
from llm.precision import resolve_precision
from llm.recompute import apply_recompute

CPU = torch.device("cpu")
TP, B, S = 2, 2, 16  # TP: the fake mesh's size


def _measure(mesh, family, precision, backend, dropout, sp, recompute="none", **shape):
    """Per-block and outside bytes one tp rank saves in a training forward and loss."""
    args = model_args(family, vocab_size=258, dropout=dropout, **shape)  # 258: divisible by tp
    policy = resolve_precision(precision, CPU)
    model = apply_tensor_parallel(build_model(args, backend), mesh, sp)
    apply_recompute(model, RecomputeConfig(name=recompute))
    model = materialize_from(model, InitSource(args, 0), CPU).to(policy.param_dtype).train()
    torch.manual_seed(0)
    ids, targets = torch.randint(0, args.vocab_size, (2, B, S))
    counter = ActivationMemoryCounter(model.layers)
    counter._seen.update(
        StorageWeakRef(local_shard(p).untyped_storage()) for p in model.parameters()
    )
    with counter, loss_parallel():
        with policy.autocast(CPU):
            logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    split = dict(tp=TP, sequence_parallel=sp)
    layer = layer_terms(args, B, S, policy, backend=backend, recompute=recompute, **split)
    outside = outside_terms(args, B, S, policy, **split)
    return counter.by_layer, layer, outside


CASES = [
    (family, precision, backend, dropout)
    for family in ("gpt2-tiny", "llama-tiny")
    for precision, backend, dropout in (
        ("fp32", "sdpa", 0.0),
        ("fp32", "eager", 0.1),
        ("bf16", "sdpa", 0.0),
    )
]


@pytest.mark.parametrize("family,precision,backend,dropout", CASES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_formula_equals_measured(fake_tp_mesh, family, precision, backend, dropout, sp):
    by_layer, layer, outside = _measure(fake_tp_mesh, family, precision, backend, dropout, sp)
    assert by_layer["layers.0"] == by_layer["layers.1"] == sum(layer.values()), layer
    assert by_layer["outside"] == sum(outside.values()), outside


@pytest.mark.parametrize("family", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_recompute_formula_equals_measured(fake_tp_mesh, family, recompute, sp):
    by_layer, layer, _ = _measure(fake_tp_mesh, family, "fp32", "eager", 0.1, sp, recompute)
    assert by_layer["layers.0"] == sum(layer.values()), layer


@pytest.mark.parametrize(
    "precision,backend,dropout,recompute",
    [
        ("fp32", "sdpa", 0.0, "none"),
        ("fp32", "eager", 0.1, "none"),
        ("bf16", "sdpa", 0.0, "none"),
        ("fp32", "sdpa", 0.0, "selective"),
    ],
)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_replicated_kv_formula_equals_measured(
    fake_tp_mesh, precision, backend, dropout, recompute, sp
):
    """Multi-query llama-tiny (1 kv head) at tp=2: wk and wv are replicated, so a rank's
    flash-like core keeps one kv head (as the split would keep 1/tp of them), eager's
    repeated k and v are its query heads', and autocast copies the whole wk and wv."""
    by_layer, layer, _ = _measure(
        fake_tp_mesh, "llama-tiny", precision, backend, dropout, sp, recompute, n_kv_heads=1
    )
    assert by_layer["layers.0"] == by_layer["layers.1"] == sum(layer.values()), layer


def test_tp_divides_what_megatron_divides(fake_tp_mesh):
    """The split is the one the measured runs show: tp=2 without sequence parallel keeps
    the norms and the column-parallel inputs whole and halves the heads' and the MLP's
    terms; sequence parallel also halves the norms (DTensor's linears still save their
    all-gathered inputs)."""
    args = model_args("gpt2-tiny", dropout=0.0)
    policy = resolve_precision("fp32", CPU)
    one = layer_terms(args, B, S, policy)
    tp = layer_terms(args, B, S, policy, tp=TP)
    sp = layer_terms(args, B, S, policy, tp=TP, sequence_parallel=True)
    whole = {"attn_norm.input", "qkv.input", "ffn_norm.input", "mlp.input"}
    assert {k for k in one if tp[k] == one[k]} == whole | {
        "attn_norm.mean_rstd",
        "ffn_norm.mean_rstd",
    }
    assert {k for k in one if sp[k] == one[k]} == {"qkv.input", "mlp.input"}
    assert all(2 * tp[k] == one[k] for k in one if k not in whole and "mean_rstd" not in k)


def _paper(tp: int, sp: bool, b: int = 4, s: int = 128, h: int = 256, a: int = 8) -> int:
    args = model_args("gpt2-tiny", d_model=h, n_heads=a, dropout=0.1)
    policy = resolve_precision("bf16_pure", CPU)  # 16-bit everything, as the paper
    terms = layer_terms(
        args, b, s, policy, backend="eager", paper=True, tp=tp, sequence_parallel=sp
    )
    return sum(terms.values())


@pytest.mark.parametrize("t", [2, 4, 8])
def test_paper_reductions_with_tensor_and_sequence_parallel(t):
    """Korthikanti et al. (2022), equations 2 and 3 (bytes per layer):
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallel alone and s·b·h/t·(34 + 5·a·s/h)
    with sequence parallel; the paper's 16-bit tensors and 1-byte dropout masks."""
    b, s, h, a = 4, 128, 256, 8
    assert t * _paper(t, False) == s * b * h * (10 * t + 24) + 5 * a * s * s * b
    assert t * _paper(t, True) == s * b * h * 34 + 5 * a * s * s * b
