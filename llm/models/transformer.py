"""One pre-norm decoder for both families; ModelArgs.family picks norm, MLP and positions.

The layout is a contract with parallel/ and recompute/: ``tok_embeddings``, ``layers`` (each
:class:`Block` maps (B, T, d) -> (B, T, d) and is the unit of recompute and FSDP wrapping),
``norm``, ``output``, and for GPT-2 ``pos_embeddings``. ``forward(..., head=fn)`` hands
the normed hidden states and ``output.weight`` to ``fn`` (a fused loss) instead of running
``output``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from llm.attention import Documents
from llm.errors import ConfigError
from llm.models.args import ModelArgs
from llm.models.layers import Attention, GeluMLP, RMSNorm, SwiGLU
from llm.models.moe import MoE


def mask_padded_vocab(logits: Tensor, args: ModelArgs) -> Tensor:
    """``logits`` (..., V) with the padded ids' columns at -inf (ModelArgs.true_vocab_size),
    so that they take no probability, no gradient, and are never sampled. In place on a plain
    tensor (the head's matmul keeps its inputs for backward, not its output); a
    vocab-sharded DTensor (tensor parallel) is masked shard by shard."""
    real = args.true_vocab_size
    if real is None:
        return logits
    if not isinstance(logits, DTensor):
        logits[..., real:] = float("-inf")
        return logits
    local = logits.to_local()
    width = local.size(-1)  # the padded vocabulary divides evenly by tp (padded_vocab)
    start = logits.device_mesh.get_local_rank() * width
    ids = torch.arange(start, start + width, device=local.device)
    masked = local.masked_fill(ids >= real, float("-inf"))
    return DTensor.from_local(
        masked, logits.device_mesh, logits.placements, shape=logits.shape, stride=logits.stride()
    )


def _norm(args: ModelArgs) -> nn.Module:
    if args.family == "gpt2":
        return nn.LayerNorm(args.d_model, eps=args.norm_eps)
    return RMSNorm(args.d_model, eps=args.norm_eps)


def _feed_forward(args: ModelArgs, index: int) -> nn.Module:
    if args.is_moe_layer(index):
        return MoE(args)
    return GeluMLP(args) if args.family == "gpt2" else SwiGLU(args)


class Block(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)); maps (B, T, d) to (B, T, d). The only
    side inputs are optional and not differentiated: packed documents and their positions."""

    def __init__(
        self, args: ModelArgs, attention_backend: str, sdpa_kernel: str = "auto", index: int = 0
    ) -> None:
        super().__init__()
        self.attention_norm = _norm(args)
        self.attention = Attention(args, attention_backend, sdpa_kernel)
        self.ffn_norm = _norm(args)
        self.feed_forward = _feed_forward(args, index)

    def forward(
        self, x: Tensor, docs: Documents | None = None, positions: Tensor | None = None
    ) -> Tensor:
        x = x + self.attention(self.attention_norm(x), docs, positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        attention_backend: str = "sdpa",
        sdpa_kernel: str = "auto",
        reset_positions: bool = False,
    ) -> None:
        super().__init__()
        self.args = args
        # With document ids: positions (RoPE, learned) restart at 0 in each document.
        self.reset_positions = reset_positions
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.d_model)
        if args.family == "gpt2":
            self.pos_embeddings = nn.Embedding(args.max_seq_len, args.d_model)
        self.dropout = nn.Dropout(args.dropout)
        self.layers = nn.ModuleList(
            Block(args, attention_backend, sdpa_kernel, i) for i in range(args.n_layers)
        )
        self.norm = _norm(args)
        self.output = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output matrix with the token embedding when the shape says so. Call again
        after anything that replaces parameters (to_empty, load_state_dict(assign=True))."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        head: Callable[[Tensor, Tensor, int | None], Tensor] | None = None,
    ) -> Tensor:
        """input_ids (B, T) int64 -> logits (B, T, V) in the compute dtype (the trainer upcasts
        for the loss, so fp32 logits are not materialised twice). ``doc_ids`` (B, T): the
        packed document of each token; given, attention stays inside documents. ``head``:
        returns ``head(hidden (B, T, d) after the final norm, output.weight (V, d), the
        tokenizer's vocabulary where V is padded past it, else None)`` in place of the
        logits (a fused loss, llm/train/loss.py); called here, inside forward, so that
        wrappers gathering or hooking parameters around forward (FSDP2's root, our ZeRO-3,
        DDP) see the head weight used as the output projection would use it."""
        t = input_ids.size(1)
        if t > self.args.max_seq_len:
            raise ConfigError(
                f"sequence length {t} exceeds model.max_seq_len={self.args.max_seq_len}; "
                "lower data.seq_len or raise model.max_seq_len"
            )
        # Built once per forward; the masks each backend derives from it are shared by layers.
        docs = None if doc_ids is None else Documents(doc_ids)
        positions = docs.positions if docs is not None and self.reset_positions else None
        h = self.tok_embeddings(input_ids)  # (B, T, d)
        if self.args.family == "gpt2":
            pos = torch.arange(t, device=input_ids.device) if positions is None else positions
            h = h + self.pos_embeddings(pos)
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h, docs, positions)
        h = self.norm(h)
        if head is not None:
            # The whole (padded) head, aligned for the GEMMs; the loss keeps the padded ids'
            # probability at 0 (llm/train/loss.py).
            return head(h, self.output.weight, self.args.true_vocab_size)
        return mask_padded_vocab(self.output(h), self.args)  # (B, T, V)


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model`` in order: ``model.layers``, a ModuleList, or a
    pipeline part's ModuleDict keyed by block index; none for a model without them."""
    layers = getattr(model, "layers", [])
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
