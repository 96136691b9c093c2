"""A checkpoint from any layout loads in one process for sampling (llm.inference.load reads
it through DCP): its weights equal a single-process run's on the same seed and data, and so
do its greedy tokens.

The layouts add partial sums in another order than one process, hence the tolerance on
weights: 1e-4 relative + 1e-5 absolute (as helpers.assert_run_matches). gpt2-tiny (moe-tiny for
expert parallel), fp32, a vocabulary of 258 in every run (tp=2 pads the byte tokenizer's 257 to 258, and the sampler
never draws the padding row).
"""

from __future__ import annotations

import pytest
import torch
from helpers import reference_runs, run

from llm.inference.generate import generate
from llm.inference.load import load_for_inference
from llm.inference.sampling import SamplingParams

STEPS = 3
VOCAB = "model.vocab_size=258"
LAYOUTS = {
    "zero2": ("parallelism=zero2", "launcher.nproc_per_node=2"),
    "fsdp_dp2_tp2": ("parallelism=fsdp", "parallelism.tp_size=2", "launcher.nproc_per_node=4"),
    "tp2_pp2": (
        "parallelism=single",
        "parallelism.tp_size=2",
        "parallelism.pp_size=2",
        "launcher.nproc_per_node=4",
        "train.micro_batch_size=8",  # one dp rank reads the whole global batch
    ),
    "zero3": ("parallelism=zero3", "launcher.nproc_per_node=2"),
    # Expert slices saved as DTensors on the (edp, ep) mesh.
    "moe_ddp_ep2": ("parallelism=ddp", "parallelism.ep_size=2", "launcher.nproc_per_node=2"),
}
# All several-rank runs: the default suite loads HF folders and one-process runs
# (tests/test_generate.py, tests/test_generate_hf.py).
SLOW = set(LAYOUTS)


def _greedy(loaded) -> list[list[int]]:
    prompts = [loaded.tokenizer.encode("def main():"), loaded.tokenizer.encode("x")]
    sampling = SamplingParams(temperature=0)
    return generate(loaded.model, prompts, 12, sampling, None, vocab_size=257).tokens


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LAYOUTS],
)
def test_layout_checkpoint_samples_as_one_process(
    tmp_path, tmp_path_factory, text_corpus, cache_dir, layout
):
    model = "moe-tiny" if layout.startswith("moe") else "gpt2-tiny"
    reference = reference_runs(tmp_path_factory, text_corpus, cache_dir, STEPS, VOCAB)
    ref = load_for_inference(str(reference(model)), None, torch.device("cpu"))
    _, out = run(
        tmp_path, layout, text_corpus, cache_dir, f"model={model}", VOCAB,
        f"train.max_steps={STEPS}", *LAYOUTS[layout],
    )  # fmt: skip
    loaded = load_for_inference(str(out), None, torch.device("cpu"))
    assert loaded.step == STEPS
    ours = dict(loaded.model.named_parameters())
    for name, value in ref.model.named_parameters():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert _greedy(loaded) == _greedy(ref)
