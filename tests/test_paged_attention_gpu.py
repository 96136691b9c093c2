"""The paged decode kernels on CUDA (`make test-gpu`): triton and flex against gather at a
llama-sized shape, and whole greedy generations that must not depend on the kernel.

fp32: within rtol 1e-4, atol 1e-4 of gather (exact fp32 products in every kernel; the sums
run in different orders over up to 2048 keys). bf16 and fp16: against gather in fp32, no
more than twice gather's own error in that dtype plus 1e-3 (FlashAttention's criterion, as
for our training kernel).
"""

from __future__ import annotations

import pytest
import torch

from llm.errors import ConfigError
from llm.inference.generate import generate
from llm.inference.paged_attention import gather_decode_attention, paged_decode_attention
from llm.inference.sampling import SamplingParams
from llm.models import build_model, materialize, model_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def llama_shaped_inputs(dtype: torch.dtype, seed: int = 0) -> dict:
    """B=16, H=32, Hkv=8, D=128, blocks of 16; lengths up to 2048 with 1 and a block edge
    among them; each sequence's blocks drawn from a shuffled pool with spare blocks."""
    g = torch.Generator().manual_seed(seed)
    bs, b, h, hkv, d = 16, 16, 32, 8, 128
    lens = torch.randint(1, 2049, (b,), generator=g)
    lens[:3] = torch.tensor([1, 2048, 512])
    blocks = (lens + bs - 1) // bs
    n_blocks = int(blocks.sum()) + 40
    order = torch.randperm(n_blocks, generator=g)
    table = torch.zeros(b, int(blocks.max()), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks.tolist()):
        table[i, :n] = order[start : start + n]
        start += n
    pools = torch.randn(2, hkv, n_blocks, bs, d, generator=g)
    return {
        "q": torch.randn(b, h, d, generator=g).to("cuda", dtype),
        "k_pool": pools[0].to("cuda", dtype),
        "v_pool": pools[1].to("cuda", dtype),
        "block_table": table.cuda(),
        "seq_lens": lens.to(torch.int32).cuda(),
    }


def fp32(x: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in x.items()}


@pytest.mark.parametrize("kernel", ["triton", "flex"])
def test_fp32_matches_gather(kernel):
    x = llama_shaped_inputs(torch.float32)
    out = paged_decode_attention(**x, kernel=kernel)
    torch.testing.assert_close(out, gather_decode_attention(**x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["triton", "flex"])
def test_16bit_error_is_within_twice_gathers(kernel, dtype):
    x = llama_shaped_inputs(dtype)
    exact = gather_decode_attention(**fp32(x))
    ours = paged_decode_attention(**x, kernel=kernel).float()
    assert ours.dtype == exact.dtype and torch.isfinite(ours).all()
    gather_err = (gather_decode_attention(**x).float() - exact).abs().max().item()
    our_err = (ours - exact).abs().max().item()
    assert our_err <= 2 * gather_err + 1e-3, (our_err, gather_err)


def test_flex_refuses_a_group_size_that_is_not_a_power_of_two():
    q = torch.randn(2, 12, 64, device="cuda")
    pool = torch.randn(4, 8, 16, 64, device="cuda")
    table = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    with pytest.raises(ConfigError, match="power of two") as err:
        paged_decode_attention(q, pool, pool, table, lens, kernel="flex")
    assert "\n" not in str(err.value)


def test_greedy_generation_is_the_same_with_every_kernel_and_without_paging():
    """A random llama-tiny in fp32: ragged prompts whose budgets run out at different steps
    (max_seq_len 96), so the batch shrinks as sequences end."""
    args = model_args("llama-tiny", max_seq_len=96)
    model = materialize(build_model(args), "cuda", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 70)
    ]
    greedy = SamplingParams(temperature=0.0)

    def tokens(**kw) -> list[list[int]]:
        return generate(model, prompts, 40, greedy, eos_id=None, block_size=16, **kw).tokens

    want = tokens(paged=False)
    assert [len(t) for t in want] == [40, 40, 40, 26]
    for kernel in ("gather", "triton", "flex"):
        assert tokens(paged=True, kernel=kernel) == want, kernel
