"""Which category an op or kernel's time belongs to.

An op is judged with the names around it: its own, then the ops and scopes that enclose it
(innermost first), and on a GPU the kernel's own name before the op that launched it. The
first category in RULES that any of those names matches wins, so a copy inside
``aten::linear`` is a matmul's, and anything under the ``optimizer`` scope is the
optimizer's, whatever its op. Communication is first: a reduce-scatter inside the optimizer
scope is communication.
"""

from __future__ import annotations

import re

# The scopes the tool opens around the step's phases (llm.train.trainer's pieces, wrapped
# at run time). data, loss and optimizer are categories; forward and backward only split
# the host's time.
SCOPES = ("data", "forward", "loss", "backward", "optimizer")
SCOPE_CATEGORIES = ("data", "loss", "optimizer")

# (category, aten ops by base name (``aten_base``), a pattern searched in each normalised
# name around an op: kernels, autograd nodes, other namespaces). Order matters: the first
# category that matches wins.
RULES: tuple[tuple[str, frozenset[str], str], ...] = (
    (
        "communication",
        frozenset(),
        r"c10d|nccl|gloo|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all",
    ),
    (
        "attention",
        frozenset(),
        r"scaled_?dot_?product|flash|efficient_attention|fmha|attention|attn",
    ),
    ("loss", frozenset(), r"cross_?entropy|log_?softmax|nll_?loss"),
    ("optimizer", frozenset(), r"^aten::foreach|^aten::fused_(adam|sgd)|^optimizer\."),
    (
        "matmul",
        frozenset(
            [
                "mm",
                "addmm",
                "bmm",
                "baddbmm",
                "addbmm",
                "linear",
                "matmul",
                "einsum",
                "scaled_mm",
                "int_mm",
            ]
        ),
        r"^(add|b)?mmbackward|^linearbackward|gemm|cublas|cutlass|xmma|wgmma|nvjet",
    ),
    (
        "elementwise",
        frozenset(
            [
                "add",
                "sub",
                "rsub",
                "mul",
                "div",
                "neg",
                "exp",
                "log",
                "pow",
                "sqrt",
                "rsqrt",
                "tanh",
                "sigmoid",
                "gelu",
                "silu",
                "relu",
                "where",
                "clamp",
                "clamp_min",
                "copy",
                "to_copy",
                "to",
                "fill",
                "zero",
                "zeros_like",
                "ones_like",
                "masked_fill",
                "dropout",
                "native_dropout",
                "bernoulli",
                "layer_norm",
                "native_layer_norm",
                "rms_norm",
                "fused_rms_norm",
                "norm",
                "linalg_vector_norm",
                "softmax",
                "mean",
                "sum",
                "cumsum",
                "lerp",
                "addcmul",
                "addcdiv",
                "abs",
                "sign",
                "maximum",
                "minimum",
                "isfinite",
                "square",
                "reciprocal",
            ]
        ),
        r"elementwise|layer_?norm|rms_?norm|dropout|gelu|silu|softmax|triton_(poi|per|red)"
        r"|reduce_kernel",
    ),
)
_COMPILED = tuple((c, ops, re.compile(p)) for c, ops, p in RULES)


def normal(name: str) -> str:
    """Lower case, without the underscores that start a name or a part of it
    (``aten::_foreach_mul_`` -> ``aten::foreach_mul_``)."""
    return re.sub(r"(?<![a-z0-9])_+", "", name.lower())


def aten_base(name: str) -> str | None:
    """An aten op's name without underscores around it or a backward suffix
    (``aten::_log_softmax_backward_data`` -> ``log_softmax``); None for other names."""
    if not name.startswith("aten::"):
        return None
    base = name.removeprefix("aten::").strip("_")
    for suffix in ("backward_data", "backward"):
        base = base.removesuffix(suffix).rstrip("_")
    return base


# Where no rule matches: "other ops" for an op, "other host time" for host-side time that is
# no op (the profiler's own scopes, autograd's node wrappers, Python between ops).
OTHER_OPS = "other ops"
HOST = "other host time"
IDLE = "idle"
CATEGORIES = (
    "matmul",
    "attention",
    "elementwise",
    "loss",
    "optimizer",
    "communication",
    "data",
    OTHER_OPS,
)
LABELS = {
    "matmul": "matmuls",
    "attention": "attention",
    "elementwise": "element-wise and norms",
    "loss": "the loss",
    "optimizer": "the optimizer",
    "communication": "communication",
    "data": "data loading",
    OTHER_OPS: "other ops",
    HOST: "other host time (Python, autograd, dispatch)",
    IDLE: "idle (no kernel running)",
}


def _matches(ops: frozenset[str], pattern: re.Pattern, names: list[str]) -> bool:
    return any(aten_base(n) in ops or pattern.search(normal(n)) for n in names)


def rule_category(names: list[str]) -> str | None:
    """The first category in RULES that any of ``names`` matches, else None."""
    return next((c for c, ops, p in _COMPILED if _matches(ops, p, names)), None)


def categorise(names: list[str], is_op: bool) -> str:
    """The category of one op's (or kernel's) time; ``names``: its own name first, then
    those enclosing it, innermost first. ``is_op`` is False for host-side events that run
    no op themselves (scopes, autograd wrappers)."""
    if _matches(*_COMPILED[0][1:], names):  # communication: before any scope
        return "communication"
    for scope in SCOPE_CATEGORIES:
        if scope in names:
            return scope
    if not is_op:
        return HOST
    return rule_category(names) or OTHER_OPS
