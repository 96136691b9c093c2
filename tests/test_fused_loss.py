"""train.fused_loss (llm/train/loss.py): the chunked loss equals the plain one (logits, then
fp32 cross-entropy) in loss and gradients, holds less memory by at least the logits, runs
end to end alone and under ZeRO-2; the Liger and cut-cross-entropy adapters hand their
libraries (stand-ins here) the right arguments; what cannot run is refused in one line."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from llm.data import IGNORE
from llm.errors import ConfigError
from llm.memory import PeakTracker, module_state_tensors
from llm.models import MODEL_SHAPES, build_model, materialize
from llm.train.loss import chunked_linear_cross_entropy, head_loss
from llm.validate import validate
from tests import fused_loss_stand_in
from tests.helpers import (
    compose_config,
    grad_norms,
    one_line,
    read_metrics,
    run,
    small_run_overrides,
    train_losses,
)

CPU = torch.device("cpu")
FP32 = 1e-5  # relative: chunked against plain in fp32
# bf16 under autocast: both paths round the logits to bf16 (8 significant bits) and their
# gradients once more; 2**-7 is two bf16 roundings (measured: 7e-8 on the loss, under 2e-3
# on the gradients).
BF16 = 2**-7
CHUNK = 10  # divides none of the row counts below (111, 256)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss with train.fused_loss=off."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def _batch(vocab: int, b: int = 3, t: int = 37, seed: int = 0):
    """Token ids and targets (B, T) with padding: the first 5 targets of the first sequence
    and the second half of the last."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t), generator=g)
    y = torch.randint(0, vocab, (b, t), generator=g)
    y[0, :5] = IGNORE
    y[-1, t // 2 :] = IGNORE
    return x, y


def _model(name: str):
    torch.manual_seed(0)
    return materialize(build_model(MODEL_SHAPES[name]), "cpu", 0)


def _loss(model, x, y, fused: str, chunk: int = CHUNK) -> torch.Tensor:
    """The summed loss as the trainer computes it under ``train.fused_loss=fused``."""
    return _plain(model(x), y) if fused == "off" else model(x, head=head_loss(fused, y, chunk))


def _loss_and_grads(model, x, y, fused: str):
    model.zero_grad(set_to_none=True)
    loss = _loss(model, x, y, fused)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_grads(got: dict, want: dict, tol: float) -> None:
    """Each parameter's gradient within ``tol`` relative (in norm). Attention key biases
    have an exact gradient of 0 (a query's softmax ignores a shift shared by its scores);
    theirs is rounding noise, held to ``tol`` of the largest gradient instead."""
    largest = max(g.double().norm() for g in want.values())
    for name, g in want.items():
        diff = (got[name].double() - g.double()).norm()
        bound = largest if name.endswith("wk.bias") else g.double().norm()
        assert diff <= tol * bound, (name, (diff / bound).item())


def test_chunked_equals_plain_on_hidden_and_head_weight():
    torch.manual_seed(0)
    n, d, v = 111, 16, 300
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    targets[::7] = IGNORE
    want = _plain((hidden @ weight.T).unsqueeze(0), targets.unsqueeze(0))
    want_grads = torch.autograd.grad(want * 3.0, (hidden, weight))
    got = chunked_linear_cross_entropy(hidden, weight, targets, CHUNK)
    got_grads = torch.autograd.grad(got * 3.0, (hidden, weight))  # a scaled loss, as trained
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want.item(), rel=FP32)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert _rel(g, w) <= FP32
    assert torch.all(got_grads[0][::7] == 0)  # padded rows take no gradient


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])  # tied, untied embeddings
def test_chunked_equals_plain_through_the_model_fp32(name):
    assert MODEL_SHAPES[name].tie_embeddings == (name == "gpt2-tiny")
    model = _model(name)
    x, y = _batch(MODEL_SHAPES[name].vocab_size)
    want, want_grads = _loss_and_grads(model, x, y, "off")
    got, got_grads = _loss_and_grads(model, x, y, "chunked")
    assert got.item() == pytest.approx(want.item(), rel=FP32)
    _assert_grads(got_grads, want_grads, FP32)
    with torch.no_grad():  # evaluation computes no gradient
        assert model(x, head=head_loss("chunked", y, CHUNK)).item() == pytest.approx(
            want.item(), rel=FP32
        )


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_chunked_equals_plain_under_bf16_autocast(name):
    model = _model(name)
    x, y = _batch(MODEL_SHAPES[name].vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _loss_and_grads(model, x, y, "off")
        got, got_grads = _loss_and_grads(model, x, y, "chunked")
    assert got.item() == pytest.approx(want.item(), rel=BF16)
    _assert_grads(got_grads, want_grads, BF16)
    assert all(g.dtype == torch.float32 for g in got_grads.values())


def _step_peak(model, x, y, fused: str, chunk: int) -> int:
    """The live-tensor tracker's peak bytes over one forward and backward."""
    tracker = PeakTracker(CPU, "logged")
    tracker.watch(lambda: module_state_tensors(model))
    model.zero_grad(set_to_none=True)
    with tracker.step(True):
        loss = _loss(model, x, y, fused, chunk)
        tracker.phase("backward")
        loss.backward()
    return tracker.last_step["total"]


def test_chunked_peak_is_below_plain_by_at_least_the_logits():
    """gpt2-tiny (V=4096, d=64), B x T = 4 x 64 = 256 rows, fp32, chunks of 64 rows. Plain
    peaks in backward with three (N, V) fp32 tensors live (4 MiB each): the log-softmax
    saved for backward, its gradient and the logits' gradient. Chunked peaks in forward with
    one chunk's logits (c, V), the head weight's gradient (V, d) and one chunk's
    contribution to it (V, d), and the hidden states' gradient (N, d): 3.06 MiB. The rest
    (the blocks' activations) is the same. Measured: 9,369,988 bytes saved of 16,348,680."""
    model = _model("gpt2-tiny")
    args = model.args
    x, y = _batch(args.vocab_size, b=4, t=64)
    rows, chunk, v, d = x.numel(), 64, args.vocab_size, args.d_model
    logits = rows * v * 4
    plain = _step_peak(model, x, y, "off", chunk)
    chunked = _step_peak(model, x, y, "chunked", chunk)
    expected = 3 * logits - 4 * (chunk * v + 2 * v * d + rows * d)
    saved = plain - chunked
    assert saved >= logits, (plain, chunked)
    assert saved == pytest.approx(expected, rel=0.01), (saved, expected)


@pytest.mark.parametrize("moe", [False, True])
def test_the_model_passes_doc_ids_and_moe_aux_loss_through(moe):
    """MoE aux losses come from the layers, not the head; document ids reach attention."""
    from llm.train.moe_stats import MoEStats

    model = _model("moe-tiny" if moe else "llama-tiny")
    x, y = _batch(model.args.vocab_size, b=2, t=32)
    doc_ids = torch.arange(32).div(10, rounding_mode="floor").expand(2, 32)
    stats = MoEStats(model, 1)

    def loss_and_grads(fused):
        model.zero_grad(set_to_none=True)
        if fused:
            loss = model(x, doc_ids=doc_ids, head=head_loss("chunked", y, CHUNK))
        else:
            loss = _plain(model(x, doc_ids=doc_ids), y)
        total = loss + stats.aux_loss() if moe else loss
        total.backward()
        return total.detach(), {n: p.grad for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(False)
    got, got_grads = loss_and_grads(True)
    assert got.item() == pytest.approx(want.item(), rel=FP32)
    _assert_grads(got_grads, want_grads, FP32)
    without_docs = _plain(model(x), y)
    assert without_docs.item() != pytest.approx(want.item(), rel=1e-3)


def _through_stand_in(monkeypatch, stand_in, model_name: str, loss: str, precision):
    """The library loss ``loss`` run through its stand-in beside ``off``: (the one call the
    stand-in saw, (rows, d, V), (loss, grads), (off's loss, off's grads))."""
    calls: list = []
    for name, module in stand_in(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    model = _model(model_name)
    x, y = _batch(model.args.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
        want = _loss_and_grads(model, x, y, "off")
        got = _loss_and_grads(model, x, y, loss)
    (call,) = calls
    return call, (x.numel(), model.args.d_model, model.args.vocab_size), got, want


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
def test_liger_adapter_hands_liger_what_it_expects(monkeypatch, precision):
    call, (rows, d, v), (got, got_grads), (want, want_grads) = _through_stand_in(
        monkeypatch, fused_loss_stand_in.liger, "llama-tiny", "liger", precision
    )
    assert call == {
        "input": ((rows, d), precision),
        "weight": ((v, d), precision),
        "ignore_index": IGNORE,
        "reduction": "sum",
        "accum_dtype": torch.float32,
        "bias_lowest_from": None,
    }
    assert got.dtype == torch.float32 and got.dim() == 0
    tol = FP32 if precision == torch.float32 else BF16
    assert got.item() == pytest.approx(want.item(), rel=tol)
    _assert_grads(got_grads, want_grads, tol)


@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
def test_cce_adapter_hands_cut_cross_entropy_what_it_expects(monkeypatch, precision):
    call, (rows, d, v), (got, got_grads), (want, want_grads) = _through_stand_in(
        monkeypatch, fused_loss_stand_in.cce, "gpt2-tiny", "cce", precision
    )
    assert call == {
        "e": ((rows, d), precision),
        "c": ((v, d), precision),
        "ignore_index": IGNORE,
        "reduction": "sum",
        "shift": False,
        "softcap": None,
    }
    assert got.dtype == torch.float32 and got.dim() == 0
    tol = FP32 if precision == torch.float32 else BF16
    assert got.item() == pytest.approx(want.item(), rel=tol)
    _assert_grads(got_grads, want_grads, tol)


# ---- end to end -----------------------------------------------------------------------
STEPS = ("train.max_steps=2",)
CHUNKED = ("train.fused_loss=chunked", "train.fused_loss_chunk=100")  # 256 rows: 100+100+56


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, text_corpus, cache_dir):
    return run(tmp_path_factory.mktemp("plain"), "off", text_corpus, cache_dir, *STEPS)[1]


def _assert_same_run(got_out, want_out):
    want, got = train_losses(want_out), train_losses(got_out)
    assert sorted(got) == [1, 2]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=FP32), step
    want_norms, got_norms = grad_norms(want_out), grad_norms(got_out)
    for step in got_norms:
        assert got_norms[step] == pytest.approx(want_norms[step], rel=FP32), step


def _outside_layers(out) -> int:
    return read_metrics(out)[0]["activation_bytes_outside_layers"]


def test_a_chunked_run_equals_the_plain_run(tmp_path, text_corpus, cache_dir, plain_run):
    _, out = run(tmp_path, "chunked", text_corpus, cache_dir, *STEPS, *CHUNKED)
    _assert_same_run(out, plain_run)
    # The trainer took the fused path: what the head keeps for backward is the head
    # weight's gradient (V, d) fp32 in place of the log-softmax (N, V) fp32 (byte
    # tokenizer: V = 257; d = 64; N = 4 x 64 rows).
    rows, v, d = 4 * 64, 257, 64
    assert _outside_layers(plain_run) - _outside_layers(out) >= 4 * (rows * v - v * d)


def test_a_run_with_a_padded_vocabulary_equals_the_plain_run(
    tmp_path, text_corpus, cache_dir, plain_run
):
    # model.vocab_multiple=64: the byte tokenizer's 257 ids in 320 rows. Each parameter's
    # init is seeded by its name, so the real rows start as the plain run's; the padded
    # logits are -inf, so the losses and gradient norms are the plain run's.
    _, out = run(tmp_path, "padded", text_corpus, cache_dir, *STEPS, "model.vocab_multiple=64")
    _assert_same_run(out, plain_run)


@pytest.mark.slow
def test_a_chunked_zero2_run_on_two_ranks_equals_the_plain_run(
    tmp_path, text_corpus, cache_dir, plain_run
):
    _, out = run(
        tmp_path,
        "zero2",
        text_corpus,
        cache_dir,
        *STEPS,
        *CHUNKED,
        "parallelism=zero2",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=2",  # 2 ranks x 2: the plain run's batch of 4
    )
    _assert_same_run(out, plain_run)


# ---- refusals -------------------------------------------------------------------------
def _validate(tmp_path, *extra: str) -> None:
    validate(compose_config(small_run_overrides(tmp_path, tmp_path, tmp_path, *extra)))


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("parallelism.pp_size=2",), "parallelism.pp_size=2"),
        (("parallelism.tp_size=2",), "parallelism.tp_size=2"),
    ],
)
def test_pipeline_and_tensor_parallel_are_refused(tmp_path, extra, says):
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, "train.fused_loss=chunked", "launcher.nproc_per_node=2", *extra)
    message = one_line(e)
    assert says in message and "train.fused_loss=off" in message


@pytest.mark.parametrize(
    ("name", "module", "package"),
    [
        ("liger", "liger_kernel.transformers", "liger-kernel"),
        ("cce", "cut_cross_entropy", "cut-cross-entropy"),
    ],
)
def test_a_library_loss_is_refused_without_its_package_or_cuda(
    tmp_path, monkeypatch, name, module, package
):
    monkeypatch.setitem(sys.modules, module, None)  # importing it fails, installed or not
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, f"train.fused_loss={name}")
    message = one_line(e)
    assert f"the {package} package" in message and "train.fused_loss=chunked" in message
    stand_in = fused_loss_stand_in.liger([]) if name == "liger" else fused_loss_stand_in.cce([])
    for key, value in stand_in.items():
        monkeypatch.setitem(sys.modules, key, value)
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, f"train.fused_loss={name}")
    message = one_line(e)
    assert "CUDA device" in message and "train.fused_loss=chunked" in message


def test_an_unknown_fused_loss_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, "train.fused_loss=fused")
    assert "off, chunked, liger, cce" in one_line(e)
