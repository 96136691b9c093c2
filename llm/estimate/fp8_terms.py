"""What precision=fp8's linears save for backward, as changes to a block's terms
(llm/estimate/activations.py), for the dense blocks the fp8 conversion touches
(llm/precision/fp8/convert.py: attention wq, wk, wv, wo; MLP w1, w2, w3).

- tensorwise and rowwise (our emulation, and torchao's Float8Linear alike) keep the input in
  the compute dtype, cast once per linear as autocast does, and the fp32 master weight
  itself: autocast's 16-bit weight copies are gone for every converted linear.
- deepseek keeps fp8 copies: each linear its own input's e4m3 codes with one fp32 scale per
  1x128 tile (1 + 4/128 bytes an element, instead of 2), and its weight's codes with one
  fp32 scale per 128x128 block. Nothing else keeps the 16-bit input a linear quantised, so
  the terms that were that input are replaced; a fused attention kernel keeps its output
  (which wo reads) whatever wo does.

Measured on CPU (tests/test_activation_formula.py, exact equality for every recipe).
"""

from __future__ import annotations

from llm.errors import ConfigError
from llm.models import ModelArgs
from llm.precision.fp8.convert import TENSOR_CORE_MULTIPLE
from llm.precision.fp8.scaling import TILE

F32 = 4


def fp8_block_terms(
    terms: dict[str, int],
    args: ModelArgs,
    batch: int,
    seq: int,
    recipe: str,
    kernel_keeps_output: bool,
) -> dict[str, int]:
    """``terms`` (a block's, under autocast) as precision=fp8 with ``recipe`` changes them.
    ``kernel_keeps_output``: the attention core is a fused kernel whose saved output wo reads
    (recompute none); else wo's input is saved by wo alone."""
    if args.moe is not None:
        raise ConfigError(
            "the activation formula does not model precision=fp8 with MoE blocks (the routed "
            "experts stay high precision, the shared ones are converted); estimate with "
            "precision=bf16 for an upper bound, or measure with train.memory_tracking"
        )
    linears = _linears(args)
    copies = sum(
        i * o * 2 for i, o in linears.values() if not _converted(recipe, i, o)
    )  # autocast still casts a linear the conversion leaves alone
    out = {k: v for k, v in terms.items() if k != "autocast.weight_copies"}
    if copies and "autocast.weight_copies" in terms:
        out["autocast.weight_copies"] = copies
    if recipe != "deepseek":
        return out
    n, h = batch * seq, args.d_model
    out["qkv.input"] = 3 * _fp8_copy(n * h)
    if not kernel_keeps_output:
        del out["wo.input"]
    out["wo.input_fp8"] = _fp8_copy(n * h)
    consumers = 1 if args.family == "gpt2" else 2
    out["mlp.input"] = consumers * _fp8_copy(n * h)
    out["mlp.w2_input"] = _fp8_copy(n * args.d_ff)
    out["fp8.weight_copies"] = sum(
        i * o + (i // TILE) * (o // TILE) * F32 for i, o in linears.values()
    )
    return out


def _fp8_copy(numel: int) -> int:
    """e4m3 codes and one fp32 scale per 1x128 tile."""
    return numel + numel // TILE * F32


def _linears(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of a dense block's converted linears."""
    h, kv, f = args.d_model, args.n_kv_heads * args.head_dim, args.d_ff
    q = args.n_heads * args.head_dim
    mlp = {"w1": (h, f), "w2": (f, h)} | ({} if args.family == "gpt2" else {"w3": (h, f)})
    return {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h)} | mlp


def _converted(recipe: str, in_features: int, out_features: int) -> bool:
    """convert_to_fp8's rule: deepseek converts all (it refuses shapes off its blocks);
    tensorwise and rowwise skip dimensions that are not multiples of 16."""
    return recipe == "deepseek" or not (
        in_features % TENSOR_CORE_MULTIPLE or out_features % TENSOR_CORE_MULTIPLE
    )
