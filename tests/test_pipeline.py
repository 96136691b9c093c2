"""Pipeline parallelism on gloo against one process, fp32, same seed and data.

Every run has the reference's global batch of 8 sequences of 64 byte tokens, split into
pipeline micro-batches of 4 (pp_microbatches=2) or 2. The pipelined step sums the same
per-token losses into the same gradients; only the order of additions differs (micro-batch
gradients are accumulated one by one, and a tied embedding's two halves meet in an
all-reduce), hence 1e-5 relative on losses and clipping norms, 1e-4 / 1e-5 on weights
(``helpers.assert_run_matches``).
"""

from __future__ import annotations

import pytest
from helpers import assert_run_matches, compose_config, one_line, run, small_run_overrides

from llm.config import ParallelismConfig
from llm.errors import ConfigError
from llm.parallel.pipeline import PipelineLayout
from llm.validate import validate

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_corpus, cache_dir):
    """One process per model shape: ``reference(model, *extra) -> output directory``."""
    runs = {}

    def get(model: str, *extra: str):
        key = (model, *extra)
        if key not in runs:
            tmp = tmp_path_factory.mktemp("pp_reference")
            runs[key] = run(
                tmp,
                "single",
                text_corpus,
                cache_dir,
                f"model={model}",
                "train.micro_batch_size=8",
                f"train.max_steps={STEPS}",
                *extra,
            )[1]
        return runs[key]

    return get


def pp_run(tmp_path, text_corpus, cache_dir, model, schedule, *extra, nproc=2, name="pp"):
    return run(
        tmp_path,
        name,
        text_corpus,
        cache_dir,
        f"model={model}",
        f"launcher.nproc_per_node={nproc}",
        "parallelism.pp_size=2",
        f"parallelism.pp_schedule={schedule}",
        "train.micro_batch_size=8",
        f"train.max_steps={STEPS}",
        *extra,
    )


@pytest.mark.parametrize(
    ("model", "schedule", "extra"),
    [
        ("gpt2-tiny", "1f1b", ("parallelism.pp_microbatches=4",)),
        ("gpt2-tiny", "gpipe", ()),
        ("llama-tiny", "1f1b", ()),
    ],
)
def test_pipeline_matches_single_process(
    tmp_path, reference, text_corpus, cache_dir, model, schedule, extra
):
    """gpt2-tiny: the tied embedding is split over the two stages (a copy on each, their
    gradients summed); llama-tiny: untied head, RMSNorm, RoPE, GQA."""
    summary, out = pp_run(tmp_path, text_corpus, cache_dir, model, schedule, *extra)
    assert summary["pp_size"] == 2 and summary["dp_size"] == 1
    assert_run_matches(reference(model), out, STEPS)
