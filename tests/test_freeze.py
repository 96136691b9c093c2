"""Frozen parameters (model.freeze): no gradient, no optimizer state, no update, the saving
in the accounting, and the same training as one process under ddp, fsdp and deepspeed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_close_weights, compose_config, final_weights, run, train_losses

from llm.config import OptimizerConfig
from llm.errors import ConfigError
from llm.models import build_model, freeze, materialize, model_args
from llm.optim import build_optimizer
from llm.validate import validate

FREEZE = "model.freeze=[tok_embeddings.*,layers.0.*]"
STEPS = 10
BYTE_VOCAB = 257  # data.tokenizer=byte in the small test runs


def frozen_name(name: str) -> bool:
    return name.startswith(("tok_embeddings.", "layers.0."))


def test_freeze_sets_requires_grad_and_the_optimizer_skips_frozen_params():
    model = materialize(build_model(model_args("gpt2-tiny", vocab_size=64)), "cpu", 0)
    frozen = freeze(model, ["tok_embeddings.*", "layers.0.*"])
    assert frozen and all(frozen_name(n) for n in frozen)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and not any(frozen_name(n) for n in trainable)
    optimizer = build_optimizer(model, OptimizerConfig())
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_groups == {id(p) for p in model.parameters() if p.requires_grad}


def test_a_pattern_matching_nothing_is_one_line_before_any_rank_starts():
    cfg = compose_config(["output_dir=/tmp/unused", "model.freeze=[layer.0.*]"])
    with pytest.raises(ConfigError, match=r"model.freeze pattern 'layer.0.\*' matches no") as e:
        validate(cfg)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    tmp = tmp_path_factory.mktemp("freeze_reference")
    return run(
        tmp,
        "single",
        text_corpus,
        cache_dir,
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        FREEZE,
    )


def optimizer_state_names(out) -> set[str]:
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    keys = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")}


def test_single_process_keeps_frozen_weights_and_holds_no_state_for_them(reference):
    summary, out = reference
    seed = compose_config(["output_dir=/tmp/unused"]).train.seed  # run.py initialises with it
    args = model_args("gpt2-tiny", vocab_size=BYTE_VOCAB)
    initial = materialize(build_model(args), "cpu", seed)
    final = final_weights(out)
    n_frozen = 0
    for name, p in initial.named_parameters():
        moved = not torch.equal(final[f"model.{name}"], p.detach())
        assert moved != frozen_name(name), name  # frozen ones unchanged, the others trained
        n_frozen += p.numel() if frozen_name(name) else 0
    states = optimizer_state_names(out)
    assert states and not any(frozen_name(n) for n in states)
    # The saving: no gradient and no AdamW moments (8 bytes per element) for frozen weights.
    mem = summary["model_state_bytes"][0]
    assert mem["params"] - mem["grads"] == 4 * n_frozen


@pytest.mark.parametrize(
    "strategy",
    [
        ("parallelism=ddp",),
        ("parallelism=fsdp",),
        pytest.param(("parallelism=deepspeed", "parallelism.zero_stage=1"), marks=pytest.mark.slow),
        ("parallelism=deepspeed", "parallelism.zero_stage=2"),
        pytest.param(("parallelism=deepspeed", "parallelism.zero_stage=3"), marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "deepspeed1", "deepspeed2", "deepspeed3"],
)
@pytest.mark.slow
def test_two_ranks_with_frozen_parameters_match_one_process(
    tmp_path, reference, text_corpus, cache_dir, strategy
):
    _, out = run(
        tmp_path,
        "run",
        text_corpus,
        cache_dir,
        "launcher.nproc_per_node=2",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
        FREEZE,
        *strategy,
    )
    ref, got = train_losses(reference[1]), train_losses(out)
    # As the unfrozen parity tests: only the order fp32 gradients are summed differs.
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    ref_weights = final_weights(reference[1])
    assert_close_weights(ref_weights, final_weights(out), rtol=1e-4, atol=1e-5)
    states = optimizer_state_names(out)
    assert states and not any(frozen_name(n) for n in states)
