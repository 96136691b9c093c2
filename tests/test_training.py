"""Training-loop correctness against single-process references: gradient accumulation,
2-rank DDP on gloo, and resume parity."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_close_weights,
    compose_config,
    final_weights,
    run,
    small_run_overrides,
    train_losses,
)

from llm.data import IGNORE, build_train_loader, prepare_data
from llm.launch.launcher import launch


def test_accumulation_equals_large_batch_with_unequal_documents(tmp_path, line_docs, cache_dir):
    # packing=false: one short document per sample, padded and masked, so micro-batches carry
    # different numbers of target tokens; the loss must be normalised over the global batch.
    common = ("data.packing=false", "train.max_steps=5", "optimizer=sgd", "optimizer.lr=0.5")
    big, out_big = run(tmp_path, "big", line_docs, cache_dir, "train.micro_batch_size=8", *common)
    acc, out_acc = run(
        tmp_path,
        "acc",
        line_docs,
        cache_dir,
        "train.micro_batch_size=2",
        "train.grad_accum_steps=4",
        *common,
    )
    ref, got = train_losses(out_big), train_losses(out_acc)
    assert sorted(ref) == list(range(1, 6))
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step
    # fp32 sums in another order: weights agree to float rounding, not bitwise.
    assert_close_weights(final_weights(out_big), final_weights(out_acc), rtol=1e-4, atol=1e-6)
    assert acc["final_val_loss"] == pytest.approx(big["final_val_loss"], rel=1e-5)
    # tokens_seen (and tokens/s) count target tokens, not padding: the loader's, 5 steps of 8.
    cfg = compose_config(small_run_overrides(out_big, line_docs, cache_dir, *common))
    loader = build_train_loader(prepare_data(cfg.data), cfg.data, 8, 0, 1, cfg.train.seed)
    targets = sum(int((next(loader)[1] != IGNORE).sum()) for _ in range(5))
    assert big["tokens_seen"] == acc["tokens_seen"] == targets < 5 * 8 * cfg.data.seq_len


def test_ddp_two_ranks_equals_single_process(tmp_path, text_corpus, cache_dir):
    steps = ("train.max_steps=20", "train.log_every=1", "parallelism.count_comm=true")
    single, out_single = run(
        tmp_path, "single", text_corpus, cache_dir, "train.micro_batch_size=8", *steps
    )
    ddp, out_ddp = run(
        tmp_path,
        "ddp",
        text_corpus,
        cache_dir,
        "parallelism=ddp",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=4",
        *steps,
    )
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    # Tolerance 1e-5 relative: the two differ only in the order fp32 gradients are summed
    # (two half-batch sums averaged by all-reduce vs one sum) over 20 AdamW steps.
    ref = train_losses(out_single)
    got = train_losses(out_ddp)
    assert sorted(ref) == sorted(got) == list(range(1, 21))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    assert_close_weights(final_weights(out_single), final_weights(out_ddp), rtol=1e-4, atol=1e-5)
    # DDP all-reduces every fp32 gradient once per step: the payload is the parameter bytes.
    params = single["model_state_bytes"][0]["params"]
    for rank in ddp["comm_bytes_per_step"]:
        assert rank["all_reduce"] == pytest.approx(params, rel=1e-6)
    assert single["comm_bytes_per_step"] == [{}]


@pytest.mark.slow
def test_ddp_skips_all_reduce_inside_accumulation(tmp_path, text_corpus, cache_dir):
    acc, _ = run(
        tmp_path,
        "ddp_acc",
        text_corpus,
        cache_dir,
        "parallelism=ddp",
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=3",
        "train.max_steps=3",
        "parallelism.count_comm=true",
    )
    params = acc["model_state_bytes"][0]["params"]
    # One all-reduce of all gradients per optimizer step, not one per micro-batch.
    assert acc["comm_bytes_per_step"][0]["all_reduce"] == pytest.approx(params, rel=0.01)


def test_resume_gives_bitwise_same_losses(tmp_path, text_corpus, cache_dir):
    full, out_full = run(tmp_path, "full", text_corpus, cache_dir, "train.max_steps=8")
    out = tmp_path / "halves"
    first = compose_config(
        small_run_overrides(
            out, text_corpus, cache_dir, "train.max_steps=8", "train.stop_at_step=4"
        )
    )
    summary_first = launch(first)
    assert summary_first["steps"] == 4 and summary_first["stopped_early"]
    second = compose_config(
        small_run_overrides(
            out, text_corpus, cache_dir, "train.max_steps=8", "checkpoint.resume=auto"
        )
    )
    summary_second = launch(second)
    assert summary_second["steps"] == 8
    ref, got = train_losses(out_full), train_losses(out)
    for step in range(1, 9):
        assert got[step] == ref[step], step  # bitwise on CPU in fp32
    assert summary_second["final_val_loss"] == full["final_val_loss"]
    assert_close_weights(final_weights(out_full), final_weights(out), rtol=0, atol=0)


def test_init_from_hugging_face_checkpoint(tmp_path, text_corpus, cache_dir):
    """model.init_from starts training from a local transformers checkpoint's weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_dir = tmp_path / "hf"
    config = GPT2Config(vocab_size=257, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(hf_dir)
    summary, out = run(
        tmp_path, "init", text_corpus, cache_dir, f"model.init_from={hf_dir}", "train.max_steps=2"
    )
    assert summary["n_params"] == sum(
        p.numel() for p in GPT2LMHeadModel.from_pretrained(hf_dir).parameters()
    )
    # The first step's loss is the checkpoint's: near chance for its random 257-way init.
    assert train_losses(out)[1] == pytest.approx(math.log(257), rel=0.05)
    # What the run builds from model.init_from computes the checkpoint's logits (a run that
    # ignored the checkpoint would still start near chance, so the loss alone proves little).
    from llm.models import materialize_from
    from llm.run import build_model_for

    cfg = compose_config(
        small_run_overrides(tmp_path / "again", text_corpus, cache_dir, f"model.init_from={hf_dir}")
    )
    meta, weights = build_model_for(cfg, 257)
    ours = materialize_from(meta, weights, torch.device("cpu")).eval()
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    batch = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(batch), hf(batch).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("llama-tiny", ("attention=eager", "scheduler=wsd", "optimizer=sgd")),
        ("gpt2-tiny", ("attention=sdpa", "scheduler=linear", "model.dropout=0.0")),
    ],
)
def test_recompute_changes_memory_not_losses(tmp_path, text_corpus, cache_dir, model, extra):
    """Full recompute re-runs each block's forward in backward: same losses, both families."""
    common = (f"model={model}", "train.max_steps=4", *extra)
    _, plain = run(tmp_path, "plain", text_corpus, cache_dir, "recompute=none", *common)
    _, recomputed = run(tmp_path, "full", text_corpus, cache_dir, "recompute=full", *common)
    ref, got = train_losses(plain), train_losses(recomputed)
    assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
