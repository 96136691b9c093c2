"""Document masking for packed sequences: the loader's document ids, the forms each backend
reads, a packed document equal to the same document alone, every CPU backend giving eager's
loss with the mask, the refusals, and a run that trains with it. Tolerance 1e-5 (fp32)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from llm.attention import Documents
from llm.attention import flex as flex_module
from llm.config import RecomputeConfig
from llm.data import TokenDataset, build_train_loader, prepare_data
from llm.errors import ConfigError
from llm.models import MODEL_SHAPES, build_model, materialize, materialize_from
from llm.recompute import apply_recompute
from llm.run import build_model_for
from llm.validate import validate
from tests.flash_attn_stand_in import stand_in
from tests.helpers import compose_config, run, small_run_overrides, train_losses
from tests.xformers_stand_in import install as install_xformers

TOL = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = (5, 9, 2, 8)  # one row of 24 tokens: four documents


def _doc_ids(lengths=LENGTHS) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)


def test_packed_samples_carry_the_document_of_each_token():
    offsets = np.array([0, 7, 10, 30, 41])
    ds = TokenDataset(np.arange(41), offsets, eos_id=-1)
    batch = ds.batch([0, 1], seq_len=8, packing=True)
    # Sample 0 is tokens 0..7 (docs 0 | 1), sample 1 tokens 8..15 (docs 1 | 2), counted from 0.
    assert batch.doc_ids.dtype == torch.int32
    assert batch.doc_ids.tolist() == [[0] * 7 + [1], [0, 0] + [1] * 6]
    assert ds.batch([0], seq_len=8, packing=False).doc_ids is None


def test_documents_give_each_backend_the_same_boundaries():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    docs = Documents(ids)
    cu, longest = docs.varlen
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 12] and longest == 6
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], list(range(6))]
    mask = docs.dense_mask(causal=True)[:, 0]
    want = [
        [ids[b, q] == ids[b, k] and k <= q for k in range(6)] for b in range(2) for q in range(6)
    ]
    assert mask.flatten(0, 1).tolist() == want


def _model(name: str, backend: str = "eager", reset_positions: bool = True, **kw):
    return materialize(
        build_model(MODEL_SHAPES[name], backend, reset_positions=reset_positions, **kw), "cpu", 0
    ).eval()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_packed_document_is_computed_as_if_alone(name):
    # Masking plus positions restarting at each document (learned for GPT-2, RoPE for Llama):
    # each document's logits equal those of a forward over that document alone.
    model = _model(name)
    ids = torch.randint(0, 4096, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model(ids, doc_ids=_doc_ids())
        start = 0
        for n in LENGTHS:
            alone = model(ids[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, **TOL)
            start += n
        assert not torch.allclose(model(ids), packed, **TOL)  # without ids: attends across


def _loss(model, ids, doc_ids) -> torch.Tensor:
    logits = model(ids[:, :-1], doc_ids=doc_ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


CPU_BACKENDS = [
    ("sdpa", "math"),
    ("sdpa", "flash"),
    ("flash_attn", "auto"),  # the adapter, on the stand-in package
    ("xformers", "auto"),  # the same
    ("flex", "auto"),  # evaluation only on CPU, uncompiled (test_attention_backends.py)
]


@pytest.mark.parametrize(("backend", "kernel"), CPU_BACKENDS, ids=lambda x: x)
def test_every_cpu_backend_gives_eagers_loss_with_the_mask(monkeypatch, backend, kernel):
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in([]))
    install_xformers(monkeypatch)
    monkeypatch.setattr(flex_module, "compiled_flex", lambda: flex_attention)
    ids = torch.randint(0, 4096, (2, 25), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.cat([_doc_ids((6, 10, 9)), _doc_ids((25,))])
    ref_model = _model("llama-tiny", reset_positions=False)  # GQA: 4 query, 2 kv heads
    model = _model("llama-tiny", backend, reset_positions=False, sdpa_kernel=kernel)
    grad = backend != "flex"
    with torch.set_grad_enabled(grad):
        ref, got = _loss(ref_model, ids, doc_ids), _loss(model, ids, doc_ids)
    torch.testing.assert_close(got, ref, **TOL)
    assert not torch.allclose(_loss(ref_model, ids, torch.zeros_like(doc_ids)), ref, **TOL)
    if grad:
        ref.backward()
        got.backward()
        for (name, p), q in zip(ref_model.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["attention.document_mask=true", "data.packing=false"],
            "document_mask=true keeps packed documents apart, but data.packing=false",
        ),
        (["attention.reset_positions=true"], "needs attention.document_mask=true"),
        (["attention=eager", "attention.sdpa_kernel=math"], "applies to attention=sdpa only"),
        (["attention=flex"], "attention=flex on cpu has no backward"),
        (["attention=flash_attn"], "needs the flash-attn package"),
        (["attention=xformers"], "needs the xformers package"),
        (
            ["attention=sdpa", "attention.sdpa_kernel=cudnn"],
            "sdpa_kernel=cudnn does not run on cpu",
        ),
        (
            ["attention=sdpa", "attention.sdpa_kernel=flash", "model.dropout=0.1"],
            "has no attention dropout",
        ),
    ],
)
def test_impossible_attention_configs_are_refused_before_ranks(
    tmp_path, text_corpus, cache_dir, overrides, message
):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose_config(small_run_overrides(tmp_path, text_corpus, cache_dir, *overrides)))
    assert "\n" not in str(e.value)


def test_a_run_with_the_mask_trains(tmp_path, line_docs, cache_dir):
    # Documents are single source lines, so almost every packed sample holds several.
    extra = ("model=llama-tiny", "train.max_steps=4", "optimizer.lr=3e-3")
    mask = ("attention.document_mask=true", "attention.reset_positions=true")
    summary, out = run(tmp_path, "masked", line_docs, cache_dir, *extra, *mask)
    losses = train_losses(out)
    assert summary["steps"] == 4 and losses[4] < losses[1]
    # The logged first loss is the masked one: the same init and first batch reproduce it
    # with the document ids, and not without them.
    cfg = compose_config(small_run_overrides(out, line_docs, cache_dir, *extra, *mask))
    prepared = prepare_data(cfg.data)
    batch = next(build_train_loader(prepared, cfg.data, 4, 0, 1, cfg.train.seed))
    model, weights = build_model_for(cfg, prepared.tokenizer.vocab_size)
    model = materialize_from(model, weights, torch.device("cpu"))
    with torch.no_grad():
        masked = model(batch.input_ids, doc_ids=batch.doc_ids)
        unmasked = model(batch.input_ids)
    ce = [F.cross_entropy(x.flatten(0, 1), batch.targets.flatten()) for x in (masked, unmasked)]
    assert ce[0].item() == pytest.approx(losses[1], rel=1e-5)
    assert ce[1].item() != pytest.approx(losses[1], rel=1e-3)


def test_recomputed_blocks_get_the_documents_too():
    # checkpoint_wrapper re-runs each block's forward with the same side inputs in backward.
    ids = torch.randint(0, 4096, (2, 25), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.cat([_doc_ids((6, 10, 9)), _doc_ids((25,))])
    grads = []
    for policy in ("none", "full"):
        model = apply_recompute(_model("llama-tiny").train(), RecomputeConfig(name=policy))
        _loss(model, ids, doc_ids).backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain, **TOL)
