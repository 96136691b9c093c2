"""Swap the transformer blocks' linears for :class:`Fp8Linear`, keeping their Parameters.

What stays in high precision follows DeepSeek-V3 §3.3: the embedding, the output head, the
norms, the attention core (scores, softmax), the MoE router (``gate``), and the optimizer
states and master weights (the optimizer sees the same fp32 Parameters). The MoE routed
experts (3-D Parameters in one grouped matmul, not nn.Linear) stay high precision for now;
the dense shared experts' w1/w2/w3 are linears like any MLP's and are converted.
"""

from __future__ import annotations

from torch import nn

from llm.errors import ConfigError
from llm.precision.fp8.linear import Fp8Linear, get_recipe
from llm.precision.fp8.scaling import TILE

# Attention wq/wk/wv/wo and MLP (SwiGLU, GELU, shared experts) w1/w2/w3.
FP8_LINEAR_NAMES = frozenset({"wq", "wk", "wv", "wo", "w1", "w2", "w3"})
# fp8 tensor cores (torch._scaled_mm) need both dimensions multiples of 16.
TENSOR_CORE_MULTIPLE = 16


def convert_to_fp8(model: nn.Module, recipe: str, kernel: bool = False) -> nn.Module:
    """``model`` with each nn.Linear named wq, wk, wv, wo, w1, w2 or w3 replaced in place by an
    Fp8Linear of ``recipe`` (tensorwise | rowwise | deepseek) holding the same Parameter
    objects: state_dict keys, parameter identities and optimizer groups are unchanged. Works
    on the meta device, before weights exist. ``kernel``: deepseek's GEMMs on our Triton
    kernel instead of emulated.

    deepseek refuses a linear whose in/out features are not multiples of 128 (its tiles and
    blocks). tensorwise and rowwise leave such linears of dimensions not multiples of 16 in
    high precision, as :func:`llm.precision.apply_fp8` does on the GPU, so both paths quantise
    the same layers."""
    spec = get_recipe(recipe)
    targets = [
        (parent, name, child, f"{prefix}.{name}" if prefix else name)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name in FP8_LINEAR_NAMES
    ]
    if spec.activations == "tile":
        for _, _, child, fqn in targets:
            _require_tiles(child, fqn)
    for parent, name, child, _ in targets:
        out_features, in_features = child.weight.shape
        if spec.activations != "tile" and (
            out_features % TENSOR_CORE_MULTIPLE or in_features % TENSOR_CORE_MULTIPLE
        ):
            continue
        setattr(parent, name, Fp8Linear.from_linear(child, recipe, kernel))
    return model


def _require_tiles(linear: nn.Linear, fqn: str) -> None:
    out_features, in_features = linear.weight.shape
    if out_features % TILE or in_features % TILE:
        raise ConfigError(
            f"precision.fp8_recipe=deepseek: {fqn} has in_features={in_features}, "
            f"out_features={out_features}, not multiples of its {TILE}x{TILE} blocks; choose "
            f"model shapes with d_model, n_kv_heads * head_dim and d_ff multiples of {TILE} "
            "(e.g. d_model 128, d_ff 384), or precision.fp8_recipe=rowwise"
        )
