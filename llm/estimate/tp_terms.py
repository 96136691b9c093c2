"""Which saved tensors Megatron's tensor-parallel split divides, by the activation formula's
term names (llm/estimate/activations.py), and the division itself.

Following llm/parallel/tensor_parallel.py: the attention core runs on n_heads/tp local heads
and the MLP on d_ff/tp local features, so everything between a column-parallel and the next
row-parallel layer is 1/tp per rank. What the blocks see whole (norms, the inputs of the
column-parallel layers, the residual dropouts, the row-parallel layers' outputs before
their reduction) stays whole, except that sequence parallel shards the norms, the residual
dropouts and the checkpointed block inputs along the sequence. Under sequence parallel
DTensor's column-parallel linear saves its all-gathered input (b·s·h whole); Megatron
saves the sequence shard and all-gathers it again in backward (Korthikanti et al. 2022,
section 4.2.2): :class:`Kernels.sp_saves_gathered_input` says which. With fewer key/value
heads than tp ranks, tensor parallel replicates wk and wv and each rank keeps one kv head
(``replicated_kv_terms``).
"""

from __future__ import annotations

# Between a column- and a row-parallel layer: the local heads and local MLP features.
SPLIT = {
    "wo.input",
    "mlp.gelu_input",
    "mlp.w2_input",
    "mlp.w1_output",
    "mlp.silu_output",
    "mlp.w3_output",
    "autocast.weight_copies",  # copies of the local shards of the split weights
    "head.weight_copy",  # the vocab-parallel head's local rows
    "loss.log_softmax",  # over the local vocabulary (loss_parallel)
    "wq.output",
    "wk.output",
    "wv.output",
    "w1.output",
    "w3.output",
}
# Inputs of column-parallel layers: whole, or (sequence parallel, Megatron) the shard.
GATHERED = {"qkv.input", "mlp.input", "head.input"}
# Outside the column/row pair: sharded along the sequence under sequence parallel only.
SEQUENCE = {"attn.dropout_mask", "mlp.dropout_mask", "embed.dropout_mask", "block.input"}
SEQUENCE_PREFIXES = ("attn_norm.", "ffn_norm.", "final_norm.")
# The eager causal mask is (s, s) whatever the heads; every other core.* term is per head.
WHOLE_CORE = {"core.causal_mask"}


def tp_divisor(name: str, tp: int, sp: bool, gathered_input_saved: bool) -> int:
    """By how much tensor parallel divides term ``name`` on each rank: tp or 1."""
    if name in SPLIT or (name.startswith("core.") and name not in WHOLE_CORE):
        return tp
    if not sp:
        return 1
    if name in SEQUENCE or name.startswith(SEQUENCE_PREFIXES):
        return tp
    if name in GATHERED and not gathered_input_saved:
        return tp
    return 1


def split_terms(
    terms: dict[str, int], tp: int, sp: bool, gathered_input_saved: bool
) -> dict[str, int]:
    """``terms`` as one of ``tp`` ranks holds them (every split term divides exactly: tp
    divides heads, d_ff, the padded vocabulary and, under sequence parallel, the sequence)."""
    if tp == 1:
        return terms
    return {name: n // tp_divisor(name, tp, sp, gathered_input_saved) for name, n in terms.items()}


def replicated_kv_terms(
    whole: dict[str, int],
    split: dict[str, int],
    tp: int,
    n_kv_heads: int,
    kv_sized_core: bool,
    kv_weight_bytes: int,
) -> dict[str, int]:
    """``split`` (one rank's terms as if the kv heads were split) corrected for replicated
    wk and wv (llm.parallel.tensor_parallel.ReplicatedKV): the attention core's k and v are
    one kv head where the kernel keeps them per kv head (``kv_sized_core``), op_sac's kept
    wk/wv outputs are the whole projections, and autocast's weight copies hold the whole
    wk and wv (``kv_weight_bytes`` of them in the copies' dtype)."""
    out = dict(split)
    if kv_sized_core:
        out |= {name: whole[name] // n_kv_heads for name in ("core.k", "core.v") if name in whole}
    out |= {name: whole[name] for name in ("wk.output", "wv.output") if name in whole}
    if "autocast.weight_copies" in whole:
        rest = whole["autocast.weight_copies"] - kv_weight_bytes
        out["autocast.weight_copies"] = rest // tp + kv_weight_bytes
    return out
