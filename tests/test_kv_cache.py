"""The KV cache (llm/inference): its bytes per token equal the formula as the live-tensor
tracker counts them, for MHA, GQA and MQA, fp32 and bf16, contiguous and paged; paged and
contiguous caches give the same tokens, also when the paged pool is small enough to preempt;
blocks are taken as tokens arrive and all come back; cached decode logits equal the full
forward's (gpt2, llama with GQA, a dropless MoE); a request joins as soon as one ends."""

from __future__ import annotations

import math

import pytest
import torch

from llm.errors import ConfigError
from llm.inference.engine import Engine, Request
from llm.inference.forward import decode, prefill
from llm.inference.generate import full_forward_logits, generate
from llm.inference.kv_cache import ContiguousKVCache, PagedKVCache, kv_bytes_per_token
from llm.inference.sampling import Sampler, SamplingParams
from llm.memory import PeakTracker
from llm.models import build_model, materialize, model_args

GREEDY = SamplingParams(temperature=0.0)
# Eight query heads, so n_heads / 4 = 2 kv heads (GQA) is distinct from one (MQA).
SHAPE = {"d_model": 64, "n_heads": 8, "n_layers": 2, "d_ff": 128}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops only: on a busy 2-core machine OpenMP's second thread made this file 10x
    slower (37 s against 3.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(name: str = "llama-tiny", seed: int = 0, **overrides):
    args = model_args(name, **overrides)
    return materialize(build_model(args), "cpu", seed).eval()


def tracked(build) -> int:
    """Bytes of the tensors ``build()`` leaves alive, counted by the peak tracker's ledger of
    live storages (every op output registered), not by the cache's own arithmetic."""
    tracker = PeakTracker(torch.device("cpu"))
    with tracker.region("kv_cache"):
        kept = build()
    assert kept is not None
    return tracker.current


@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_formula_equals_the_tracked_bytes(kv_heads, dtype):
    args = model_args("llama-tiny", **SHAPE, n_kv_heads=kv_heads)
    per_token = kv_bytes_per_token(args, dtype)
    assert per_token == 2 * args.n_layers * kv_heads * args.head_dim * dtype.itemsize
    rows, row_len, blocks, block = 3, 40, 5, 16
    assert tracked(lambda: ContiguousKVCache(args, rows, row_len, dtype, "cpu")) == (
        per_token * rows * row_len
    )
    assert tracked(lambda: PagedKVCache(args, blocks, block, dtype, "cpu")) == (
        per_token * blocks * block
    )


PROMPTS = [[5, 9, 2, 7, 1, 3, 3, 8, 4, 6, 2, 11, 13], [7], [1, 2, 3, 4, 5, 6, 7, 8], [42, 17, 3]]


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=3)],
    ids=["greedy", "seeded"],
)
def test_paged_and_contiguous_give_the_same_tokens(sampling):
    model = tiny(**SHAPE, n_kv_heads=2)
    contiguous = generate(model, PROMPTS, 20, sampling, None, paged=False)
    paged = generate(model, PROMPTS, 20, sampling, None, paged=True, block_size=4)
    # 12 blocks of 4 cannot hold the four sequences at their longest (51 blocks): the
    # engine preempts and prefills again, and the tokens must not change.
    small = generate(model, PROMPTS, 20, sampling, None, block_size=4, cache_tokens=48)
    assert small.stats.preemptions > 0
    assert [len(t) for t in contiguous.tokens] == [20] * 4
    assert paged.tokens == contiguous.tokens
    assert small.tokens == contiguous.tokens


def _engine(model, cache) -> Engine:
    return Engine(model, cache, Sampler(GREEDY, torch.device("cpu")))


def test_blocks_are_taken_as_tokens_arrive_and_all_come_back():
    model = tiny(**SHAPE, n_kv_heads=2)
    block = 4
    cache = PagedKVCache(model.args, 14, block, torch.float32, "cpu")
    engine = _engine(model, cache)
    lengths = [(13, 9), (1, 16), (8, 5), (3, 12), (6, 6)]
    for i, (prompt, new) in enumerate(lengths):
        engine.submit(Request(i, PROMPTS[0][:prompt], new))
    held_at_most = 0
    while engine.waiting or engine.running:
        engine.step()
        for r in engine.running:  # each holds its tokens but the newest, ceil(n / block) blocks
            n = len(r.tokens) - 1
            assert cache.lens[r.id] == n
            assert len(cache.tables[r.id]) == math.ceil(n / block)
        taken = sum(len(t) for t in cache.tables.values())
        assert cache.allocator.free_blocks == cache.allocator.n_blocks - taken
        held_at_most = max(held_at_most, taken)
    assert held_at_most > 10  # the pool filled up
    assert engine.stats.preemptions > 0  # and a request was preempted, freed and readmitted
    assert cache.allocator.free_blocks == cache.allocator.n_blocks
    assert not cache.tables and not cache.lens
    assert sorted((len(r.prompt), len(r.out)) for r in engine.finished) == sorted(lengths)


def test_a_preempted_request_frees_its_blocks_and_is_readmitted():
    model = tiny(**SHAPE, n_kv_heads=2)
    cache = PagedKVCache(model.args, 5, 4, torch.float32, "cpu")
    engine = _engine(model, cache)
    engine.submit(Request(0, [1, 2, 3, 4, 5, 6, 7], 6))  # 7 tokens: 2 blocks, then 3
    engine.submit(Request(1, [9, 8, 7, 6, 5], 6))  # 5 tokens: 2 blocks (+1 kept free), then 3
    engine.step()  # both admitted, decoded once: 8 and 6 tokens cached, 4 of 5 blocks taken
    assert [r.id for r in engine.running] == [0, 1] and cache.allocator.free_blocks == 1
    engine.step()  # request 0's 9th token takes the last block
    assert cache.allocator.free_blocks == 0 and engine.stats.preemptions == 0
    engine.step()
    engine.step()  # request 1's 9th token needs a third block: it is the latest, it yields
    assert engine.stats.preemptions == 1
    assert [r.id for r in engine.running] == [0] and [r.id for r in engine.waiting] == [1]
    assert 1 not in cache.tables and cache.allocator.free_blocks == 2
    engine.step()  # no admission right after a preemption
    assert [r.id for r in engine.waiting] == [1]
    engine.run()
    assert sorted(r.id for r in engine.finished) == [0, 1]
    assert sorted(len(r.out) for r in engine.finished) == [6, 6]
    assert cache.allocator.free_blocks == 5


def _decode_logits(model, cache, tokens: list[int], prompt: int) -> torch.Tensor:
    """Logits of positions prompt-1 .. len-2: the prompt's last from prefill, then one token
    at a time through the cache (the tokens are fed, not sampled)."""
    cache.add(0, len(tokens))
    out = [prefill(model, torch.tensor([tokens[:prompt]]), cache, [0])[0, -1]]
    for p in range(prompt, len(tokens) - 1):
        assert cache.extend(0, 1)
        out.append(decode(model, torch.tensor([tokens[p]]), cache, [0])[0])
    return torch.stack(out)


@pytest.mark.parametrize(
    "name,overrides",
    [("gpt2-tiny", {}), ("llama-tiny", {"n_kv_heads": 2}), ("moe-tiny", {})],
    ids=["gpt2", "llama_gqa", "moe_dropless"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cached_decode_logits_equal_the_full_forward(name, overrides, paged):
    model = tiny(name, seed=1, **overrides)
    args = model.args
    assert args.moe is None or args.moe.capacity_factor is None  # dropless: no batch effects
    tokens = torch.randint(0, args.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    tokens = tokens.tolist()
    if paged:
        cache = PagedKVCache(args, 4, 16, torch.float32, "cpu")
    else:
        cache = ContiguousKVCache(args, 1, 64, torch.float32, "cpu")
    cached = _decode_logits(model, cache, tokens, prompt=11)
    full = full_forward_logits(model, tokens)[10:-1]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_a_request_joins_as_soon_as_one_ends():
    """Two rows, four requests: the third is admitted in the step after the first ends, while
    the second is still decoding; the fourth when the third ends."""
    model = tiny(**SHAPE, n_kv_heads=2)
    engine = _engine(model, ContiguousKVCache(model.args, 2, 32, torch.float32, "cpu"))
    for i, new in enumerate((3, 8, 3, 3)):
        engine.submit(Request(i, [i + 1, 2, 3], new))
    seen = []
    while engine.waiting or engine.running:
        engine.step()
        seen.append(([r.id for r in engine.running], [r.id for r in engine.finished]))
    assert seen[:4] == [
        ([0, 1], []),  # each prefill samples one token, the decode step a second
        ([1], [0]),  # 0 ends at its third: its row comes back
        ([1, 2], [0]),  # 2 joins at once, beside 1
        ([1], [0, 2]),
    ]
    assert seen[4] == ([1, 3], [0, 2])
    assert [r.id for r in engine.finished] == [0, 2, 3, 1]


def test_a_sequence_outgrowing_its_contiguous_row_is_refused():
    model = tiny(**SHAPE, n_kv_heads=2)
    cache = ContiguousKVCache(model.args, 2, 4, torch.float32, "cpu")
    cache.add(0, 4)
    cache.lens[0] = 4
    with pytest.raises(ConfigError, match="outgrew its KV row of 4 tokens") as err:
        cache.extend(0, 1)
    assert "\n" not in str(err.value)
