"""Bytes autograd saves for backward, per transformer block and outside the blocks, as a pure
function of the shape: Korthikanti et al. (2022)'s count redone term by term for the blocks
of llm/models (docs/recompute.md, "The activation formula").

Each term is one storage autograd keeps (views and tensors saved by two ops count once), in
the dtype it really has. Facts the paper idealises away are parameters of :class:`Kernels`:
``paper=True`` sets them to the paper's assumptions, under which a GPT-2 block with dropout
in 16-bit reduces to s·b·h·(34 + 5·a·s/h) bytes (34·s·b·h selective, 2·s·b·h full).

Measured on CPU (tests/test_activation_formula.py, exact equality); CUDA differs only where
a kernel does (dropout keeps a 1-byte mask; sdpa picks flash/efficient kernels), which is
derived from torch's kernels, not measured here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.errors import ConfigError
from llm.estimate.fp8_terms import check_fp8_formula, fp8_block_terms, fp8_linear_outputs
from llm.estimate.tp_terms import replicated_kv_terms, split_terms
from llm.models import ModelArgs
from llm.parallel.tensor_parallel import kv_replicated
from llm.precision import PrecisionPolicy

F32, I64, BOOL = 4, 8, 1
# Recompute policies this formula knows; ``every`` applies to full. budget and offload are
# priced by :func:`estimate_activations` from the ``none`` terms (see there).
RECOMPUTE = ("none", "full", "selective", "op_sac", "op_sac_every_other_mm")
FLASH_LIKE = ("flash", "efficient", "cudnn", "flash_attn", "flex", "triton", "xformers")
# Flash-like kernels handed K and V repeated to the query heads, so the copies are saved
# (xFormers' backward takes no grouped heads: llm/attention/xformers_backend.py).
REPEATS_KV = ("xformers",)
# Outside-the-blocks terms of a pipeline's first stage (the lookups); the last holds the rest.
FIRST_STAGE_TERMS = {"embed.ids", "pos_embed.ids", "embed.dropout_mask"}


@dataclass(frozen=True)
class Kernels:
    """What the kernels in use really save, beyond the structure of the block."""

    norm_stats: bool = True  # LayerNorm saves mean and rstd, RMSNorm its rstd
    scores_fp32: bool = True  # eager upcasts the scores; softmax saves an fp32 output
    causal_mask: bool = True  # eager's (s, s) bool mask, saved by masked_fill
    dropout_mask_bytes: int | None = None  # None: the input's itemsize (CPU), 1: CUDA's bool
    weight_copies: bool = True  # autocast's casts of weights are saved by matmuls
    cast_per_consumer: bool = True  # autocast casts an activation once per linear reading it
    # Sequence parallel: the column-parallel linears save their all-gathered input (DTensor),
    # not the sequence shard Megatron saves and gathers again in backward.
    sp_saves_gathered_input: bool = True


PAPER = Kernels(
    norm_stats=False,
    scores_fp32=False,
    causal_mask=False,
    dropout_mask_bytes=1,
    weight_copies=False,
    cast_per_consumer=False,
    sp_saves_gathered_input=False,
)


@dataclass(frozen=True)
class Dtypes:
    """Itemsizes: residual stream (``p``, the parameter dtype) and matmul outputs (``c``)."""

    p: int
    c: int
    autocast: bool

    @classmethod
    def of(cls, policy: PrecisionPolicy) -> Dtypes:
        autocast = policy.compute_dtype != policy.param_dtype
        return cls(policy.param_dtype.itemsize, policy.compute_dtype.itemsize, autocast)


@dataclass
class ActivationEstimate:
    """Per-layer terms (name -> bytes) for a block without and with its recompute, the
    outside-the-blocks terms, and totals for the whole model on one micro-batch."""

    layer: dict[str, int]  # one block under the chosen recompute policy
    layer_none: dict[str, int]  # one block with every activation kept
    outside: dict[str, int]
    n_layers: int
    every: int = 0  # full recompute of every k-th block (indices k-1, 2k-1, ...); 0: none
    recomputed_layer: dict[str, int] = field(default_factory=dict)

    @property
    def per_layer(self) -> int:
        return sum(self.layer.values())

    @property
    def n_recomputed(self) -> int:
        return self.n_layers // self.every if self.every else 0

    def block(self, index: int) -> int:
        """Bytes block ``index`` (of the whole model) keeps."""
        recomputed = self.every and (index + 1) % self.every == 0
        return sum((self.recomputed_layer if recomputed else self.layer).values())

    @property
    def blocks(self) -> int:
        return sum(self.block(i) for i in range(self.n_layers))

    @property
    def total(self) -> int:
        return self.blocks + sum(self.outside.values())


def outside_by_stage(outside: dict[str, int]) -> tuple[int, int]:
    """Bytes of the outside terms a pipeline's first stage holds (the lookups) and its last
    (final norm, head and loss)."""
    first = sum(v for k, v in outside.items() if k in FIRST_STAGE_TERMS)
    return first, sum(outside.values()) - first


def sdpa_kernel_used(kernel: str, device: str, dtypes: Dtypes, dropout: bool, head_dim: int) -> str:
    """The sdpa kernel ``auto`` resolves to. CPU (measured): flash unless dropout, then math.
    CUDA (torch's priority order): flash for 16-bit, head_dim <= 256; else efficient."""
    if kernel != "auto":
        return kernel
    if device == "cpu":
        return "math" if dropout else "flash"
    return "flash" if dtypes.c == 2 and head_dim <= 256 else "efficient"


def layer_terms(
    args: ModelArgs,
    batch: int,
    seq: int,
    policy: PrecisionPolicy,
    *,
    backend: str = "sdpa",
    sdpa_kernel: str = "auto",
    device: str = "cpu",
    recompute: str = "none",
    training: bool = True,
    paper: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, int]:
    """Bytes one block saves for backward, by term, under ``recompute`` (none | selective |
    full | op_sac | op_sac_every_other_mm; full's block keeps only its input), on one of
    ``tp`` tensor-parallel ranks (llm/estimate/tp_terms.py). ``paper``: the paper's
    idealised kernels."""
    if recompute not in RECOMPUTE:
        raise ConfigError(
            f"the activation formula knows recompute {', '.join(RECOMPUTE)}, not {recompute!r}"
        )
    k = PAPER if paper else Kernels()
    terms = _block_terms(
        args, batch, seq, policy, k, backend, sdpa_kernel, device, recompute, training
    )
    if policy.fp8:
        check_fp8_formula(tp)
    split = split_terms(terms, tp, sequence_parallel, k.sp_saves_gathered_input)
    if tp == 1 or not kv_replicated(args.n_kv_heads, tp):
        return split
    dt = Dtypes.of(policy)
    kind = _kernel_kind(backend, sdpa_kernel, device, dt, training and args.dropout > 0, args)
    # Flash-like kernels and selective recompute keep k and v per kv head; eager (and the
    # xformers adapter) repeat them to the query heads, which tensor parallel splits as before.
    kv_sized = recompute == "selective" or (
        recompute == "none" and kind in FLASH_LIKE and kind not in REPEATS_KV
    )
    kv_weights = 2 * args.d_model * args.n_kv_heads * args.head_dim * dt.c
    return replicated_kv_terms(terms, split, tp, args.n_kv_heads, kv_sized, kv_weights)


def _kernel_kind(
    backend: str, sdpa_kernel: str, device: str, dt: Dtypes, drop: bool, args: ModelArgs
) -> str:
    """The attention kernel that runs: the backend, or the one sdpa picks."""
    if backend == "sdpa":
        return sdpa_kernel_used(sdpa_kernel, device, dt, drop, args.head_dim)
    return backend


def _block_terms(
    args: ModelArgs,
    batch: int,
    seq: int,
    policy: PrecisionPolicy,
    k: Kernels,
    backend: str,
    sdpa_kernel: str,
    device: str,
    recompute: str,
    training: bool,
) -> dict[str, int]:
    dt = Dtypes.of(policy)
    b, s, h = batch, seq, args.d_model
    if recompute == "full":
        return {"block.input": b * s * h * dt.p}
    drop = training and args.dropout > 0
    kind = _kernel_kind(backend, sdpa_kernel, device, dt, drop, args)
    if recompute.startswith("op_sac"):
        fp32_outputs = fp8_linear_outputs(args, policy.fp8_recipe) if policy.fp8 else frozenset()
        every_other = recompute.endswith("every_other_mm")
        return _op_sac_terms(args, b, s, dt, kind, device, every_other, fp32_outputs)
    mask = k.dropout_mask_bytes or (BOOL if device == "cuda" else None)
    terms: dict[str, int] = {}
    terms |= _norm_terms("attn_norm", args, b, s, dt, k)
    terms["qkv.input"] = _linear_inputs(3, b * s * h, dt, k)
    if args.family == "llama":
        terms["rope.cos_sin"] = 2 * s * args.head_dim * dt.c
    if recompute == "selective":
        terms |= _kept_qkv(args, b, s, dt)
    else:
        terms |= _core_terms(kind, args, b, s, dt, k, drop, mask, device)
    terms["wo.input"] = b * s * h * dt.c  # eager/math: a copy of the transposed output
    if drop:
        terms["attn.dropout_mask"] = b * s * h * (mask or dt.c)
    terms |= _norm_terms("ffn_norm", args, b, s, dt, k)
    terms |= _mlp_terms(args, b, s, dt, k)
    if drop:
        terms["mlp.dropout_mask"] = b * s * h * (mask or dt.c)
    if dt.autocast and k.weight_copies:
        terms["autocast.weight_copies"] = _block_weight_numel(args) * dt.c
    if policy.fp8:  # a fused kernel's saved output is wo's input unless recomputed
        return fp8_block_terms(
            terms, args, b, s, policy.fp8_recipe, kind in FLASH_LIKE and recompute == "none"
        )
    return terms


def _norm_terms(name: str, args: ModelArgs, b: int, s: int, dt: Dtypes, k: Kernels) -> dict:
    """LayerNorm saves its input and (mean, rstd) in the input dtype. Our RMSNorm upcasts:
    it saves the fp32 input (the input itself when the stream is fp32), the fp32 rstd, and
    the normalised tensor cast back, which the gain multiplies."""
    n = b * s * args.d_model
    if args.family == "gpt2":
        terms = {f"{name}.input": n * dt.p}
        if k.norm_stats:
            terms[f"{name}.mean_rstd"] = 2 * b * s * dt.p
        return terms
    terms = {f"{name}.input_fp32": n * F32}
    if k.norm_stats:
        terms[f"{name}.rstd"] = b * s * F32
    terms[f"{name}.normed"] = n * dt.p
    return terms


def _linear_inputs(consumers: int, numel: int, dt: Dtypes, k: Kernels) -> int:
    """A norm's output read by ``consumers`` linears: one storage, except under autocast,
    which casts it to the compute dtype once per linear (activations are not cached)."""
    if dt.autocast:
        return (consumers if k.cast_per_consumer else 1) * numel * dt.c
    return numel * dt.p


def _kept_qkv(args: ModelArgs, b: int, s: int, dt: Dtypes) -> dict:
    """Selective recompute keeps the attention core's inputs (after RoPE) and recomputes
    scores, softmax, dropout and the kernel's outputs."""
    q = b * s * args.n_heads * args.head_dim * dt.c
    kv = b * s * args.n_kv_heads * args.head_dim * dt.c
    return {"core.q": q, "core.k": kv, "core.v": kv}


def _core_terms(
    kind: str,
    args: ModelArgs,
    b: int,
    s: int,
    dt: Dtypes,
    k: Kernels,
    drop: bool,
    mask: int | None,
    device: str,
) -> dict:
    """The attention core: q, k, v in, (b, a, s, d) out. ``kind``: eager, or the kernel."""
    a, d = args.n_heads, args.head_dim
    heads = b * a * s * d  # one (b, a, s, d) tensor's elements
    scores = b * a * s * s
    if kind in FLASH_LIKE:
        kv = b * (a if kind in REPEATS_KV else args.n_kv_heads) * s * d * dt.c
        rows = _lse_rows(kind, device, dt, s)
        # The kernel's output is saved too, but it is laid out (b, s, a, d), so the
        # transpose-reshape wo reads is a view of it: counted once, as "wo.input".
        return {
            "core.q": heads * dt.c,
            "core.k": kv,
            "core.v": kv,
            "core.logsumexp": b * a * rows * F32,
        }
    if kind not in ("eager", "math"):
        raise ConfigError(f"the activation formula has no model of attention kernel {kind!r}")
    # eager: matmuls save q and the repeated/transposed k, v as (b*a, s, d) copies. math on
    # CPU upcasts 16-bit inputs to fp32 and computes everything there.
    m = F32 if kind == "math" and device == "cpu" else dt.c
    soft = F32 if kind == "eager" and k.scores_fp32 else m
    terms = {"core.q": heads * m, "core.k": heads * m}
    if kind == "eager" and k.causal_mask:
        terms["core.causal_mask"] = s * s * BOOL
    terms["core.softmax"] = scores * soft
    if drop:
        terms["core.dropout_mask"] = scores * (mask or m)
        terms["core.probs"] = scores * m
    elif soft != m:
        terms["core.probs"] = scores * m  # the softmax cast down to v's dtype
    terms["core.v"] = heads * m
    return terms


def _lse_rows(kind: str, device: str, dt: Dtypes, s: int) -> int:
    """Rows of a flash-like kernel's saved logsumexp: CUDA's efficient (CUTLASS) kernel pads
    them to multiples of 32; xFormers runs that kernel for fp32 (FlashAttention for 16-bit)."""
    cutlass = kind == "efficient" or (kind == "xformers" and dt.c == F32)
    return -(-s // 32) * 32 if cutlass and device == "cuda" else s


def _op_sac_terms(
    args: ModelArgs,
    b: int,
    s: int,
    dt: Dtypes,
    kind: str,
    device: str,
    every_other_mm: bool,
    fp32_outputs: frozenset[str] = frozenset(),
) -> dict:
    """op_sac keeps the block's input (the checkpoint's), the outputs of the linear matmuls
    (with ``every_other_mm`` only the 1st, 3rd, ... in forward order) and of the attention
    core's kernels (eager/math: the two bmm, scores and probs @ V; fused: the output and its
    log-sum-exp); norms, casts, activations, RoPE and dropout are recomputed."""
    h, kv, f = args.d_model, args.n_kv_heads * args.head_dim, args.d_ff
    mlp = ("w1", "w2") if args.family == "gpt2" else ("w1", "w3", "w2")
    widths = {"wq": h, "wk": kv, "wv": kv, "wo": h, "w1": f, "w3": f, "w2": h}
    order = ("wq", "wk", "wv", "wo", *mlp)
    kept = order[::2] if every_other_mm else order
    terms = {"block.input": b * s * h * dt.p}
    # precision=fp8's emulated GEMMs return fp32 (fp8_terms.py).
    terms |= {
        f"{name}.output": b * s * widths[name] * (F32 if name in fp32_outputs else dt.c)
        for name in kept
    }
    heads = b * args.n_heads * s * args.head_dim
    if kind in FLASH_LIKE:
        rows = _lse_rows(kind, device, dt, s)
        terms["core.output"] = heads * dt.c
        terms["core.logsumexp"] = b * args.n_heads * rows * F32
    else:
        m = F32 if kind == "math" and device == "cpu" else dt.c
        terms["core.scores"] = b * args.n_heads * s * s * m
        terms["core.output"] = heads * m
    return terms


def _mlp_terms(args: ModelArgs, b: int, s: int, dt: Dtypes, k: Kernels) -> dict:
    if args.moe is not None:
        return _moe_terms(args, b, s, dt, k)
    n, f = b * s * args.d_model, b * s * args.d_ff * dt.c
    if args.family == "gpt2":
        return {"mlp.input": _linear_inputs(1, n, dt, k), "mlp.gelu_input": f, "mlp.w2_input": f}
    return {
        "mlp.input": _linear_inputs(2, n, dt, k),
        "mlp.w1_output": f,  # silu's input
        "mlp.silu_output": f,
        "mlp.w3_output": f,
        "mlp.w2_input": f,  # silu(w1 x) * w3 x
    }


def _moe_terms(args: ModelArgs, b: int, s: int, dt: Dtypes, k: Kernels) -> dict:
    """A MoE feed-forward (llm/models/moe.py, the loop kernel, dropless) on one rank: only
    the activated experts' activations, top_k per token, whatever the routing (the runs
    sum to b*s*top_k rows). Every block of the shape is counted as a MoE block (a shape
    with first_dense or every > 1 is estimated as if all were)."""
    moe, h = args.moe, args.d_model
    n, rows = b * s, b * s * moe.top_k
    f = rows * args.d_expert * dt.c
    shared = moe.n_shared_experts * args.d_expert
    terms = {
        "moe.input": _linear_inputs(1 + 2 * bool(shared), n * h, dt, k),  # gate (+ shared)
        "moe.router_probs": n * moe.n_experts * F32 if moe.router == "softmax" else 0,
        "moe.topk_indices": n * moe.top_k * I64,
        # norm_topk divides the k weights by their sum, which keeps both.
        "moe.topk_weights": (n * moe.top_k * F32 + n * F32) if moe.norm_topk else 0,
        "moe.order": rows * I64,  # the weights' gather index
        "moe.token": rows * I64,  # the rows' gather and scatter index
        "moe.weights": rows * F32,  # each row's weight, multiplied in fp32
        "moe.expert_input": rows * h * (dt.c if dt.autocast else dt.p),
        "moe.w1_output": f,
        "moe.silu_output": f,
        "moe.w3_output": f,
        "moe.w2_input": f,
        "moe.expert_output": rows * h * dt.c,  # times its weight
        "moe.weighted_output": rows * h * dt.p,  # what index_add_ sums per token (it keeps it)
        # The per-layer loss's f_i, saved by its product; the pooled loss is made after the
        # forward, from sums that save nothing in the block.
        "moe.balance_share": (
            moe.n_experts * F32 if moe.aux_loss_coef > 0 and moe.balance_loss == "per_layer" else 0
        ),
    }
    if moe.router == "sigmoid":  # sigmoid's output, and the sum that normalises it
        terms["moe.router_scores"] = n * moe.n_experts * F32 + n * F32
    if moe.z_loss_coef > 0:  # logsumexp keeps the logits and its result
        terms["moe.router_logits"] = n * moe.n_experts * F32 + n * F32
    if shared:
        g = n * shared * dt.c
        terms |= {"moe.shared_w1_output": g, "moe.shared_silu_output": g,
                  "moe.shared_w3_output": g, "moe.shared_w2_input": g}  # fmt: skip
    return {name: v for name, v in terms.items() if v}


def _block_weight_numel(args: ModelArgs) -> int:
    h, kv, f = args.d_model, args.n_kv_heads * args.head_dim, args.d_ff
    mlp = (3 if args.family == "llama" else 2) * h * f
    if args.moe is not None:  # the gate, every expert (cast whole) and the shared ones
        mlp = args.moe.n_experts * h + 3 * h * args.d_expert * (
            args.moe.n_experts + args.moe.n_shared_experts
        )
    return 2 * h * h + 2 * h * kv + mlp


def outside_terms(
    args: ModelArgs,
    batch: int,
    seq: int,
    policy: PrecisionPolicy,
    *,
    device: str = "cpu",
    training: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
    fused_loss: str = "off",
) -> dict[str, int]:
    """Embeddings, final norm, head and the loss (logits upcast, log-softmax in fp32), on one
    of ``tp`` ranks: the vocab-parallel head's logits and log-softmax are 1/tp. With
    ``train.fused_loss`` (never under tp) the head and the loss are one op that saves its
    own tensors (``fused_loss_terms``)."""
    k, dt = Kernels(), Dtypes.of(policy)
    b, s, h, v = batch, seq, args.d_model, args.vocab_size
    terms = {"embed.ids": b * s * I64}
    if args.family == "gpt2":
        terms["pos_embed.ids"] = s * I64
    if training and args.dropout > 0:
        terms["embed.dropout_mask"] = b * s * h * (BOOL if device == "cuda" else dt.p)
    terms |= _norm_terms("final_norm", args, b, s, dt, k)
    if fused_loss != "off":
        return terms | fused_loss_terms(fused_loss, b * s, h, v, dt)
    terms["head.input"] = _linear_inputs(1, b * s * h, dt, k)
    if dt.autocast:
        terms["head.weight_copy"] = v * h * dt.c
    terms["loss.log_softmax"] = b * s * v * F32
    terms["loss.targets"] = b * s * I64
    terms["loss.total_weight"] = F32
    return split_terms(terms, tp, sequence_parallel, k.sp_saves_gathered_input)


def fused_loss_terms(name: str, n: int, h: int, v: int, dt: Dtypes) -> dict[str, int]:
    """What ``train.fused_loss=name`` keeps from forward to backward for ``n`` tokens of width
    ``h`` and a vocabulary of ``v`` (llm/train/loss.py). chunked and Liger-Kernel compute
    both gradients in the forward and keep them: (n, h) in the hidden states' dtype
    (chunked: the stream's; Liger: the compute dtype it is handed) and (v, h), chunked's
    accumulated in fp32, Liger's cast to the weight it is handed (the compute dtype).
    cut-cross-entropy keeps its inputs and recomputes: the hidden states and the head
    weight in the compute dtype (copies where autocast casts them), the fp32 log-sum-exp,
    and int64 targets and indices of the valid ones. Liger's and cut-cross-entropy's rows
    are read from their autograd Functions' saved tensors, not measured here (CUDA only)."""
    if name == "chunked":
        return {"loss.grad_hidden": n * h * dt.p, "loss.grad_weight": v * h * F32}
    if name == "liger":
        return {"loss.grad_hidden": n * h * dt.c, "loss.grad_weight": v * h * dt.c}
    terms = {"loss.hidden": n * h * dt.c, "loss.lse": n * F32, "loss.targets": 2 * n * I64}
    if dt.autocast:
        terms["head.weight_copy"] = v * h * dt.c
    return terms


def estimate_activations(
    args: ModelArgs,
    batch: int,
    seq: int,
    policy: PrecisionPolicy,
    *,
    backend: str = "sdpa",
    sdpa_kernel: str = "auto",
    device: str = "cpu",
    recompute: str = "none",
    every: int = 1,
    budget: float = 1.0,
    tp: int = 1,
    sequence_parallel: bool = False,
    fused_loss: str = "off",
) -> ActivationEstimate:
    """The whole model's activations for one micro-batch on one of ``tp`` tensor-parallel
    ranks; full recompute with ``every=k`` checkpoints blocks k, 2k, ... and keeps the
    others whole."""
    split = dict(tp=tp, sequence_parallel=sequence_parallel)
    kw = dict(backend=backend, sdpa_kernel=sdpa_kernel, device=device, **split)
    none = layer_terms(args, batch, seq, policy, **kw)
    outside = outside_terms(args, batch, seq, policy, device=device, fused_loss=fused_loss, **split)
    if recompute in ("budget", "offload"):
        # offload: every saved tensor goes to host memory, none stays on the device (the
        # estimator shows ``layer_none`` in its host column). budget: torch.compile's
        # partitioner is asked to keep at most ``budget`` of what it keeps by default; its
        # choice is made at compile time and not derived here, so the target is the figure.
        share = 0.0 if recompute == "offload" else budget
        return ActivationEstimate(
            layer={name: int(n * share) for name, n in none.items()},
            layer_none=none,
            outside=outside,
            n_layers=args.n_layers,
        )
    if recompute == "full":
        return ActivationEstimate(
            layer=none,
            layer_none=none,
            outside=outside,
            n_layers=args.n_layers,
            every=every,
            recomputed_layer=layer_terms(args, batch, seq, policy, recompute="full", **kw),
        )
    return ActivationEstimate(
        layer=layer_terms(args, batch, seq, policy, recompute=recompute, **kw),
        layer_none=none,
        outside=outside,
        n_layers=args.n_layers,
    )
