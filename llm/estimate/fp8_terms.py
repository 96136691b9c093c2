"""What precision=fp8's linears save for backward, as changes to a block's terms
(llm/estimate/activations.py). The fp8 conversion (llm/precision/fp8/convert.py) touches
attention wq, wk, wv, wo and the MLP's w1, w2, w3 (a dense block's, or a MoE block's shared
experts'); the MoE router and routed experts stay in the compute dtype.

- tensorwise and rowwise (our emulation, and torchao's Float8Linear alike) keep the input in
  the compute dtype, cast once per linear as autocast does, and the fp32 master weight
  itself: autocast's 16-bit weight copies are gone for every converted linear.
- deepseek keeps fp8 copies: each linear its own input's e4m3 codes with one fp32 scale per
  1x128 tile (1 + 4/128 bytes an element, instead of 2), and its weight's codes with one
  fp32 scale per 128x128 block. Nothing else keeps the 16-bit input a linear quantised, so
  the terms that were that input are replaced; a fused attention kernel keeps its output
  (which wo reads) whatever wo does.
- recompute=op_sac keeps the outputs of the linears' matmuls: the emulated fp8 GEMM's are
  fp32 (its matmul multiplies dequantised fp32 operands), whatever the recipe.

Measured on CPU, in emulation (tests/test_activation_formula_fp8.py, exact equality for
every recipe). On a GPU the real kernels save what they save for backward the same way;
under op_sac, their outputs are not aten.mm's (torchao's _scaled_mm, our Triton GEMM), which
this count does not model.
"""

from __future__ import annotations

from llm.errors import ConfigError
from llm.models import ModelArgs
from llm.precision.fp8.convert import TENSOR_CORE_MULTIPLE
from llm.precision.fp8.scaling import TILE

F32, C16 = 4, 2  # an fp32 element; precision=fp8's compute dtype, bf16


def fp8_block_terms(
    terms: dict[str, int],
    args: ModelArgs,
    batch: int,
    seq: int,
    recipe: str,
    kernel_keeps_output: bool,
) -> dict[str, int]:
    """``terms`` (a block's, under autocast, recompute none or selective) as precision=fp8
    with ``recipe`` changes them. ``kernel_keeps_output``: the attention core is a fused
    kernel whose saved output wo reads (recompute none); else wo's input is saved by wo."""
    converted = {
        name: (i, o) for name, (i, o) in fp8_linears(args).items() if _converted(recipe, i, o)
    }
    out = dict(terms)
    copies = out.pop("autocast.weight_copies", 0)
    # What autocast still casts: the router, routed experts, linears the conversion left alone.
    if copies and (left := copies - C16 * sum(i * o for i, o in converted.values())):
        out["autocast.weight_copies"] = left
    if recipe != "deepseek":
        return out
    n, h = batch * seq, args.d_model
    out["qkv.input"] = 3 * _fp8_copy(n * h)
    if not kernel_keeps_output:
        del out["wo.input"]
    out["wo.input_fp8"] = _fp8_copy(n * h)
    if args.moe is None:
        consumers = 1 if args.family == "gpt2" else 2
        out["mlp.input"] = consumers * _fp8_copy(n * h)
        out["mlp.w2_input"] = _fp8_copy(n * args.d_ff)
    elif shared := args.moe.n_shared_experts * args.d_expert:
        # The router's 16-bit cast stays; the shared experts' w1 and w3 take fp8 copies.
        out["moe.input"] = n * h * C16 + 2 * _fp8_copy(n * h)
        out["moe.shared_w2_input"] = _fp8_copy(n * shared)
    out["fp8.weight_copies"] = sum(
        i * o + (i // TILE) * (o // TILE) * F32 for i, o in converted.values()
    )
    return out


def fp8_linear_outputs(args: ModelArgs, recipe: str) -> frozenset[str]:
    """The linears whose matmul outputs are fp32 under precision=fp8: the ones the conversion
    turns into fp8 linears."""
    return frozenset(n for n, (i, o) in fp8_linears(args).items() if _converted(recipe, i, o))


def fp8_linears(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of a block's linears the conversion may touch."""
    h, kv, f = args.d_model, args.n_kv_heads * args.head_dim, args.d_ff
    q = args.n_heads * args.head_dim
    attention = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h)}
    if args.moe is not None:
        s = args.moe.n_shared_experts * args.d_expert
        shared = {"shared.w1": (h, s), "shared.w3": (h, s), "shared.w2": (s, h)}
        return attention | (shared if s else {})
    mlp = {"w1": (h, f), "w2": (f, h)} | ({} if args.family == "gpt2" else {"w3": (h, f)})
    return attention | mlp


def check_fp8_formula(tp: int) -> None:
    if tp > 1:
        raise ConfigError(
            "the activation formula models precision=fp8 on one tensor-parallel rank (fp8 "
            "with tensor parallel is refused by training)"
        )


def _fp8_copy(numel: int) -> int:
    """e4m3 codes and one fp32 scale per 1x128 tile."""
    return numel + numel // TILE * F32


def _converted(recipe: str, in_features: int, out_features: int) -> bool:
    """convert_to_fp8's rule: deepseek converts all (it refuses shapes off its blocks);
    tensorwise and rowwise skip dimensions that are not multiples of 16."""
    return recipe == "deepseek" or not (
        in_features % TENSOR_CORE_MULTIPLE or out_features % TENSOR_CORE_MULTIPLE
    )
