"""The inference estimate (``estimate.mode=inference``): what one tensor-parallel rank holds
to decode ``estimate.batch`` sequences of ``estimate.context`` tokens each, as
``python -m llm.generate`` runs them, and the largest batch and the longest context that fit.

Rows, per tp rank, in ``generate.dtype`` (the weights' dtype; the KV cache takes it too):

- weights: the parameters the rank holds after llm.parallel.tensor_parallel's split
  (``tp_local_shapes``): column- and row-parallel projections 1/tp, the vocabulary padded to
  a multiple of tp and split, norms and GPT-2's position table whole, wk/wv whole where tp
  replicates them (n_kv_heads < tp). A MoE shape holds every expert (no expert parallel).
- kv_cache: batch x context tokens of ``kv_bytes_per_token`` (2 x n_layers x the rank's kv
  heads x head_dim x element size; a rank keeps one kv head where they are replicated).
- working: the largest forward's transient tensors (``working_bytes``): a prefill of one
  context-long prompt or a decode step of the batch, whichever holds more.

Nothing else is counted: no headroom is kept for the CUDA context, library workspaces,
NCCL buffers or allocator fragmentation, so a configuration at the limit of the fit answers
may still run out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm.config import Config
from llm.errors import ConfigError
from llm.estimate.estimator import GIB
from llm.inference.kv_cache import kv_bytes_per_token
from llm.models import ModelArgs, build_model
from llm.parallel.tensor_parallel import check_tensor_parallel, tp_local_shapes
from llm.precision import REDUCE_DTYPES


@dataclass
class InferenceEstimate:
    """Bytes one tp rank holds for ``batch`` x ``context`` tokens, and what fits."""

    tp: int
    tp_rank: int
    batch: int
    context: int
    dtype: str
    n_params_per_rank: int  # a tied head once
    device: dict[str, int]  # weights, kv_cache, working
    kv_bytes_per_token: int
    device_memory: int
    max_batch: int  # the largest batch that fits at this context (0: none)
    max_context: int  # the longest context that fits at this batch, at most max_seq_len
    max_seq_len: int

    @property
    def total(self) -> int:
        return sum(self.device.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_json(self) -> dict:
        """Training mode's key names where they mean the same (device_bytes, total_bytes)."""
        out = dataclasses.asdict(self)
        out["device_bytes"] = out.pop("device")
        out["device_memory_bytes"] = out.pop("device_memory")
        return {"mode": "inference", **out, "total_bytes": self.total, "fits": self.fits}


def inference_dtype(cfg: Config) -> str:
    """generate.dtype as python -m llm.generate resolves it on estimate.device: auto is bf16
    on a GPU, fp32 on CPU."""
    if cfg.generate.dtype == "auto":
        return "bf16" if cfg.estimate.kernels == "cuda" else "fp32"
    return cfg.generate.dtype


def check_inference(cfg: Config, args: ModelArgs, context: int) -> None:
    """What the inference estimate cannot size, refused in one line."""
    e, par = cfg.estimate, cfg.parallelism
    if e.num_params is not None or e.plan:
        raise ConfigError(
            "estimate.mode=inference sizes a model shape for one tensor-parallel layout; drop "
            "estimate.num_params and estimate.plan (they are training-mode keys)"
        )
    if par.pp_size > 1:
        raise ConfigError(
            f"estimate.mode=inference with parallelism.pp_size={par.pp_size}: the inference "
            "estimate splits over tensor parallel only; set parallelism.pp_size=1"
        )
    if context > args.max_seq_len:
        raise ConfigError(
            f"estimate.context={context} is longer than {cfg.model.name}'s max_seq_len "
            f"{args.max_seq_len}; lower estimate.context or set model.max_seq_len"
        )
    if args.moe is not None and par.tp_size > 1:
        raise ConfigError(
            f"a mixture-of-experts model with tp_size={par.tp_size}: tensor parallel does not "
            "split MoE blocks here; use parallelism.tp_size=1"
        )
    check_tensor_parallel(args, par.tp_size, context, sp=False)


def mlp_width(args: ModelArgs) -> int:
    """Elements per token live at the MLP's peak (whole, before the tp split): SwiGLU's
    silu(w1 x), w3 x and their product (3 x d_ff), GELU's w1 x and its GELU (2 x d_ff); a
    MoE block's top_k routed rows and shared experts as if all were live at once (the loop
    over experts frees each one's, so an upper bound)."""
    if args.family == "gpt2":
        return 2 * args.d_ff
    dense = 3 * args.d_ff
    if args.moe is None:
        return dense
    moe = args.moe
    routed = 3 * (moe.top_k + moe.n_shared_experts) * (moe.d_expert or args.d_ff)
    has_dense = moe.first_dense > 0 or moe.every > 1
    return max(routed, dense if has_dense else 0)


def token_elements(args: ModelArgs, tp: int) -> int:
    """Elements per token live at a forward's peak, beyond weights and cache: the residual
    stream three times (the old h, the block's output and the new h while they add: 3d,
    whole on every tp rank) and the larger of the logits (V / tp: the head keeps them
    vocab-sharded) and the MLP's peak (``mlp_width`` / tp)."""
    return 3 * args.d_model + max(args.vocab_size, mlp_width(args)) // tp


def prefill_bytes(args: ModelArgs, context: int, tp: int, dtype: torch.dtype) -> int:
    """A prefill of one prompt of ``context`` tokens (the engine prefills each prompt alone;
    attention's own memory is linear in the tokens with SDPA's causal kernels)."""
    return context * token_elements(args, tp) * dtype.itemsize


def decode_bytes(args: ModelArgs, batch: int, context: int, tp: int, dtype: torch.dtype) -> int:
    """A decode step of ``batch`` tokens: one layer's keys and values of every sequence
    gathered out of the cache for attention (the contiguous cache and the paged ``gather``
    kernel copy them: kv_cache / n_layers; a kernel that reads the cache in place does not),
    plus ``token_elements`` per sequence. A bound: the read peaks inside a block and the
    logits at the head, not together; the difference is the batch's logits, small beside
    the read past a few hundred tokens of context."""
    read = batch * context * kv_bytes_per_token(args, dtype, tp) // args.n_layers
    return read + batch * token_elements(args, tp) * dtype.itemsize


def working_bytes(args: ModelArgs, batch: int, context: int, tp: int, dtype: torch.dtype) -> int:
    """The larger of the two forwards llm.generate runs (each measured against the peak
    tracker on CPU in tests/test_estimate_inference.py)."""
    return max(
        prefill_bytes(args, context, tp, dtype), decode_bytes(args, batch, context, tp, dtype)
    )


def weight_bytes(args: ModelArgs, tp: int, tp_rank: int, itemsize: int) -> tuple[int, int]:
    """(parameters, bytes) tp rank ``tp_rank`` holds; ``args`` has the padded vocabulary."""
    shapes = tp_local_shapes(build_model(args), tp, tp_rank)  # a tied weight is one key
    n = sum(s.numel() for s in shapes.values())
    return n, n * itemsize


def largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [1, hi] with fits(n), fits monotone (True then False); 0: none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def estimate_inference(cfg: Config, args: ModelArgs) -> InferenceEstimate:
    """``cfg.estimate``'s batch and context (None: 1 and the model's max_seq_len) on
    parallelism.tp_size ranks, the rank estimate.rank % tp shown (tp ranks hold the same)."""
    e, tp = cfg.estimate, cfg.parallelism.tp_size
    batch, context = e.batch or 1, e.context or args.max_seq_len
    check_inference(cfg, args, context)
    args = args.padded(cfg.model.vocab_multiple * tp)
    name = inference_dtype(cfg)
    dtype = REDUCE_DTYPES[name]  # the names of generate.dtype: fp32, bf16, fp16
    n, weights = weight_bytes(args, tp, e.rank % tp, dtype.itemsize)
    per_token = kv_bytes_per_token(args, dtype, tp)
    memory = int(e.device_memory_gb * GIB)

    def rows(b: int, c: int) -> dict[str, int]:
        working = working_bytes(args, b, c, tp, dtype)
        return {"weights": weights, "kv_cache": b * c * per_token, "working": working}

    def fits(b: int, c: int) -> bool:
        return sum(rows(b, c).values()) <= memory

    return InferenceEstimate(
        tp=tp,
        tp_rank=e.rank % tp,
        batch=batch,
        context=context,
        dtype=name,
        n_params_per_rank=n,
        device=rows(batch, context),
        kv_bytes_per_token=per_token,
        device_memory=memory,
        # No batch past memory / (context x per token) fits: its cache alone is too big.
        max_batch=largest(lambda b: fits(b, context), memory // (context * per_token)),
        max_context=largest(lambda c: fits(batch, c), args.max_seq_len),
        max_seq_len=args.max_seq_len,
    )
