"""Decode attention through a block table (llm.inference.paged_attention): gather against
plain SDPA over each sequence's tokens laid out contiguously, then the Triton and
FlexAttention kernels against gather, on MHA, GQA and MQA shapes with ragged lengths (1, on a
block edge, ragged) and blocks scattered through the pool (see triton_paged_cases.py).

CPU, fp32: within rtol 1e-4, atol 2e-5 (fp32 rounding of a different summation order, as for
our FlashAttention). The Triton kernel runs in Triton's interpreter in a subprocess; flex runs
its unfused reference here, and compiled (to C++) in a slow test. CUDA: test_paged_attention_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton_paged_cases import CASES, make_inputs, poisoned

from llm.errors import ConfigError
from llm.inference.flex_paged import flex_paged_decode_attention, paged_block_mask
from llm.inference.paged_attention import (
    KERNELS,
    gather_decode_attention,
    paged_decode_attention,
    resolve_kernel,
)

REPO = Path(__file__).resolve().parent.parent
RTOL, ATOL = 1e-4, 2e-5


def contiguous_reference(x: dict) -> torch.Tensor:
    """Each sequence alone: SDPA of its query over its own keys and values, (B, H, D)."""
    rows = []
    for b, (k, v) in enumerate(zip(x["keys"], x["values"], strict=True)):
        q = x["q"][b][None, :, None]  # (1, H, 1, D)
        rows.append(F.scaled_dot_product_attention(q, k[None], v[None], enable_gqa=True)[0, :, 0])
    return torch.stack(rows)


def gather(x: dict) -> torch.Tensor:
    return gather_decode_attention(
        x["q"], x["k_pool"], x["v_pool"], x["block_table"], x["seq_lens"]
    )


@pytest.mark.parametrize("name", list(CASES))
def test_gather_equals_sdpa_over_each_sequence_alone(name):
    x = make_inputs(CASES[name])
    torch.testing.assert_close(gather(x), contiguous_reference(x), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The Triton kernel's output for every case, in Triton's interpreter, with NaN in every
    pool row no sequence holds."""
    pytest.importorskip("triton")
    from llm.attention.triton_flash import triton_interpreter_problem

    if why := triton_interpreter_problem():
        pytest.skip(why)
    path = tmp_path_factory.mktemp("triton_paged") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = Path(__file__).parent / "triton_paged_cases.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_gather_and_reads_only_live_rows(interpreted, name):
    x = make_inputs(CASES[name])
    torch.testing.assert_close(interpreted[name], gather(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_flex_mask_matches_gather(name):
    """flex's unfused reference evaluates mask_mod at every pool position: the pool outside
    the sequences is random, so a mask that admits any of it is off."""
    x = make_inputs(CASES[name])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = flex_paged_decode_attention(
            x["q"], x["k_pool"], x["v_pool"], x["block_table"], x["seq_lens"], compiled=False
        )
    torch.testing.assert_close(out, gather(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_flex_block_mask_lists_exactly_each_sequences_blocks(name):
    """The compiled kernel reads only listed blocks, and skips mask_mod on the full ones: the
    full list is the blocks below seq_len // block_size, the partial one the block after."""
    case, x = CASES[name], make_inputs(CASES[name])
    n_blocks, bs = x["k_pool"].shape[1], case.block_size
    mask = paged_block_mask(x["block_table"], x["seq_lens"], n_blocks, bs)
    listed = mask.to_dense()[:, 0, 0]  # (B, n_blocks): 1 where the block is read
    for b, n in enumerate(case.lens):
        mine = x["block_table"][b, : -(-n // bs)].long()
        want = torch.zeros(n_blocks, dtype=listed.dtype)
        want[mine] = 1
        assert torch.equal(listed[b], want), b
        assert int(mask.full_kv_num_blocks[b]) == n // bs
        assert int(mask.kv_num_blocks[b]) == int(n % bs != 0)


@pytest.mark.slow
def test_compiled_flex_on_cpu_matches_gather_and_skips_other_blocks():
    """Compiled (C++ on CPU; about 20 s), through the dispatch, with NaN in every block no
    sequence holds: a block read that the BlockMask should skip turns the output NaN."""
    x = make_inputs(CASES["gqa_bs32_D64"])
    dead_blocks = ~x["live"].any(1)[None, :, None, None]
    k_pool, v_pool = (p.masked_fill(dead_blocks, float("nan")) for p in (x["k_pool"], x["v_pool"]))
    out = paged_decode_attention(x["q"], k_pool, v_pool, x["block_table"], x["seq_lens"], "flex")
    torch.testing.assert_close(out, gather(x), rtol=RTOL, atol=ATOL)


def test_every_kernel_is_dispatched():
    assert KERNELS == ("gather", "triton", "flex")
    x = make_inputs(CASES["mha_bs16_D32"])
    with pytest.raises(ConfigError, match="unknown"):
        paged_decode_attention(
            x["q"], x["k_pool"], x["v_pool"], x["block_table"], x["seq_lens"], "x"
        )


def test_auto_is_triton_on_cuda_and_gather_elsewhere():
    pytest.importorskip("triton")
    assert resolve_kernel("auto", "cuda") == "triton"
    assert resolve_kernel("auto", "cpu") == "gather"
    assert resolve_kernel("flex", "cpu") == "flex"
    assert resolve_kernel("gather", "cpu") == "gather"


@pytest.mark.parametrize(
    ("name", "device", "match"),
    [
        ("triton", "cpu", "needs a CUDA device"),
        ("vllm", "cuda", "unknown"),
        ("flex", "mps", "CUDA or CPU"),
    ],
)
def test_impossible_kernels_are_refused_in_one_line(name, device, match):
    with pytest.raises(ConfigError, match=match) as err:
        resolve_kernel(name, device)
    assert "\n" not in str(err.value)


def test_without_triton_auto_falls_back_and_triton_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert resolve_kernel("auto", "cuda") == "gather"
    with pytest.raises(ConfigError, match=r"triton==3\.9\.0"):
        resolve_kernel("triton", "cuda")


def test_triton_kernel_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make_inputs(CASES["mha_bs16_D32"])
    with pytest.raises(ConfigError, match="CUDA tensors") as err:
        paged_decode_attention(
            x["q"], x["k_pool"], x["v_pool"], x["block_table"], x["seq_lens"], "triton"
        )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "match"),
    [(8, 32, "power of two >= 16"), (24, 32, "power of two >= 16"), (16, 48, "head dims")],
)
def test_triton_kernel_refuses_unsupported_shapes_in_one_line(block_size, head_dim, match):
    pytest.importorskip("triton")
    from llm.inference.triton_paged import triton_paged_decode_attention

    q = torch.randn(2, 4, head_dim)
    pool = torch.randn(2, 4, block_size, head_dim)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ConfigError, match=match) as err:
        triton_paged_decode_attention(q, pool, pool, table, torch.ones(2, dtype=torch.int32))
    assert "\n" not in str(err.value)


def test_poisoned_pools_keep_live_rows_and_mark_the_rest():
    """The Triton cases' NaN pools: every row a sequence holds is untouched, every other NaN."""
    x = make_inputs(CASES["gqa_bs128_D16"])
    k_pool, _ = poisoned(x)
    assert torch.equal(k_pool[:, x["live"]], x["k_pool"][:, x["live"]])
    assert k_pool[:, ~x["live"]].isnan().all()
