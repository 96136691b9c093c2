"""Compute time of one micro-batch on one rank, shape by shape from a device profile
(``estimate.device=NAME``, llm.estimate.device_profile).

The FLOPs are llm.estimate.layout_estimate's (6 per weight, the attention scores, the
forward recompute replays, the head on the last stage); the rate each part runs at is the
profile's at its shape. A block's weights run at the FLOP-weighted harmonic mean of its
linears' rates, each a (b·s) x d_model by d_model x n matmul with n its sharded side: q, k
and v together ((h + 2·kv)/tp), the output projection (h/tp), the MLP's input and output
matrices (d_ff/tp each; a SwiGLU's gate and up together, 2·d_ff/tp; a MoE block's experts
at d_expert). The head is one of n = vocabulary/tp. Attention runs at the backend's
kernel's rate at the model's head dim and the sequence length. Full recompute replays a
third of the block's time (its forward), selective a third of the attention's.
"""

from __future__ import annotations

from llm.estimate.device_profile import DeviceProfile
from llm.estimate.layout import Layout, block_params, rank_blocks
from llm.models import ModelArgs, blocks_params
from llm.parallel.tensor_parallel import padded_vocab


def _linears(args: ModelArgs, tp: int) -> list[tuple[float, float]]:
    """(n, FLOPs share) of a block's linears on one tp rank: n is the sharded side, the share
    is the matrix's width x n."""
    h, kv = args.d_model, args.n_kv_heads * args.head_dim
    mlp = args.d_ff if args.moe is None else args.d_expert
    gated = args.family != "gpt2"
    up = (2 if gated else 1) * mlp
    return [((h + 2 * kv) / tp, h + 2 * kv), (h / tp, h), (up / tp, up), (mlp / tp, mlp)]


def weights_flops_per_s(args: ModelArgs, tokens: int, tp: int, profile: DeviceProfile) -> float:
    """A block's weight FLOP/s: the harmonic mean of its linears' rates, weighted by FLOPs."""
    linears = _linears(args, tp)
    total = sum(share for _, share in linears)
    seconds_per_flop = sum(
        share / total / profile.matmul_flops_per_s(tokens, args.d_model, n) for n, share in linears
    )
    return 1 / seconds_per_flop


def block_seconds(
    args: ModelArgs, seq: int, backend: str, layout: Layout, profile: DeviceProfile
) -> float:
    """One block's compute for one micro-batch on one tp rank, with the forward that
    ``layout.recompute`` replays."""
    tp, tokens = layout.tp, layout.micro_batch * seq
    weights = block_params(args, 1) if args.moe is None else blocks_params(args, active=True)
    weights = weights if args.moe is None else weights / args.n_layers
    weights_s = 6 * weights * tokens / tp / weights_flops_per_s(args, tokens, tp, profile)
    attention = 12 * seq * args.n_heads * args.head_dim * tokens / tp
    attention_s = attention / profile.attention_flops_per_s(backend, args.head_dim, seq)
    block_s = weights_s + attention_s
    replay = {"none": 0.0, "selective": attention_s / 3, "full": block_s / 3}[layout.recompute]
    return block_s + replay


def compute_seconds(
    args: ModelArgs,
    seq: int,
    backend: str,
    layout: Layout,
    pp_rank: int,
    profile: DeviceProfile,
) -> float:
    """One micro-batch's compute on one tp rank of pipeline rank ``pp_rank``."""
    block_s = block_seconds(args, seq, backend, layout, profile)
    total = rank_blocks(args.n_layers, layout, pp_rank) * block_s
    if pp_rank == layout.pp - 1:
        tp, tokens = layout.tp, layout.micro_batch * seq
        vocab = padded_vocab(args.vocab_size, tp)
        head = 6 * vocab * args.d_model * tokens / tp
        total += head / profile.matmul_flops_per_s(tokens, args.d_model, vocab / tp)
    return total
