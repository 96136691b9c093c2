"""The FLOPs behind MFU (llm.models.counting) against torch's own counter,
``torch.utils.flop_counter.FlopCounterMode``, on one forward + backward of GPT-2 and Llama
shapes (eager attention, whose two matmuls per head the counter sees; CPU's SDPA kernel has no
registered formula). MFU's convention (PaLM) is model FLOPs: 6N + 12·L·T·d_attn per token,
every score counted. The counter agrees within 0.5%: the convention's N also holds the norm
gains and biases, which are no matmuls. Under recompute the hardware computes more, the
blocks' forward again; the counter sees that, the convention does not (MFU stays model
FLOPs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from llm.config import RecomputeConfig
from llm.models import build_model, materialize, model_args
from llm.models.counting import flops_per_token
from llm.recompute import apply_recompute, recompute_policy

BATCH, SEQ = 2, 64


def _counted(name: str, recompute: str = "none") -> tuple[int, float]:
    args = model_args(name)
    cfg = RecomputeConfig(name=recompute)
    policy = recompute_policy(cfg)
    model = materialize(apply_recompute(build_model(args, "eager"), cfg, policy), "cpu", seed=0)
    data = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1))
    with FlopCounterMode(display=False) as counter, policy.forward_context():
        logits = model(data[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).backward()
    return counter.get_total_flops(), flops_per_token(args, SEQ) * BATCH * SEQ


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-mini", "llama-tiny"])
def test_mfu_flops_equal_torchs_count(name):
    counted, convention = _counted(name)
    assert counted == pytest.approx(convention, rel=5e-3)


def test_full_recompute_computes_each_blocks_forward_again_up_to_its_last_matmul():
    """Under recompute=full the counter sees each block's forward again, except the MLP's
    second matmul: torch's non-reentrant checkpoint stops recomputing once the last tensor
    backward needs is back, and that matmul's output is not one. MFU's convention counts
    none of it."""
    counted, convention = _counted("gpt2-mini", "full")
    plain, _ = _counted("gpt2-mini")
    a = model_args("gpt2-mini")
    d = a.d_model
    # q, k, v and the output projection (4d²) and the MLP's first matmul (4d²), 2 FLOPs
    # per weight, plus QKᵀ and AV (4·T·d), per token and block.
    again = a.n_layers * (2 * 8 * d * d + 4 * SEQ * d) * BATCH * SEQ
    assert counted - plain == again
    assert counted > convention * 1.1
