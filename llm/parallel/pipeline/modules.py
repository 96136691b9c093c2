"""A pipeline rank's part of the model, under the whole model's parameter names, and the
stage modules torch's schedules run.

``PipelinePart`` holds what this rank's stages hold, named as in ``Transformer``
(``tok_embeddings``, ``layers.3...``: blocks in a ModuleDict keyed by their index in the
whole model, ``norm``, ``output``), so its state dict is a subset of the whole model's and
DCP checkpoints load across layouts. It is what strategies wrap, materialise, checkpoint and
build the optimizer from. ``Stage`` is one stage's view of it: the same submodules (shared,
not copied) and the forward of that stage, which ``PipelineStage`` runs.

Tied embeddings (GPT-2): the first stage's token embedding and the last stage's head are
two parameters when different ranks hold them, equal at init (the head reads the
embedding's initial values) and kept equal by summing their gradients
(``llm.parallel.pipeline.tied``); on one rank (V-shaped schedules) they stay one parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

from llm.models import Transformer, WeightSource, mask_padded_vocab, param_name
from llm.parallel.pipeline.layout import PipelineLayout

TIED_HEAD = "output.weight"
EMBEDDING = "tok_embeddings.weight"


class PipelinePart(nn.Module):
    """The modules of this rank's stages, under the whole model's names."""

    def __init__(self, model: Transformer, layout: PipelineLayout, pp_rank: int) -> None:
        super().__init__()
        self.args = model.args
        self.layout = layout
        self.stage_ids = layout.stages_of(pp_rank)
        blocks = layout.stage_blocks()
        self.first = 0 in self.stage_ids
        self.last = layout.n_stages - 1 in self.stage_ids
        if self.first:
            self.tok_embeddings = model.tok_embeddings
            if hasattr(model, "pos_embeddings"):
                self.pos_embeddings = model.pos_embeddings
            self.dropout = model.dropout
        self.layers = nn.ModuleDict(
            {str(i): model.layers[i] for s in self.stage_ids for i in blocks[s]}
        )
        if self.last:
            self.norm = model.norm
            self.output = model.output
        # A tied head on a rank without the embedding is a copy of its own.
        self.tied_copy = model.args.tie_embeddings and self.last and not self.first
        if self.tied_copy:
            self.output.weight = nn.Parameter(torch.empty_like(model.output.weight))
        # What every stage's forward runs in (the Trainer's autocast and recompute context).
        self.context: Callable[[], AbstractContextManager] = nullcontext
        self._stages: list[Stage] | None = None

    def tie_weights(self) -> None:
        """Share the head with the embedding when this rank holds both (tensor parallel
        calls this after replacing parameters)."""
        if self.args.tie_embeddings and self.first and self.last:
            self.output.weight = self.tok_embeddings.weight

    def freeze(self, patterns: list[str]) -> None:
        """``model.freeze`` on this rank's parameters. A pattern may match another stage's
        only (llm.validate checked each against the whole model); a tied head copy is
        frozen with the embedding, as one process freezes the shared parameter."""
        for name, param in self.named_parameters():
            matched = EMBEDDING if self.tied_copy and name == TIED_HEAD else name
            if any(fnmatchcase(matched, pattern) for pattern in patterns):
                param.requires_grad_(False)

    def tied_half(self) -> nn.Parameter | None:
        """This rank's copy of a tied embedding whose first and last stage are on different
        ranks (the embedding with the first stage, the head copy with the last), else None."""
        if not self.args.tie_embeddings or self.first == self.last:
            return None  # untied, both ends here (one parameter), or neither end here
        return self.tok_embeddings.weight if self.first else self.output.weight

    def weights(self, source: WeightSource) -> WeightSource:
        """``source`` with a tied head copy read from the embedding's initial values."""
        return _TiedCopySource(source) if self.tied_copy else source

    def stages(self) -> list[Stage]:
        """One module per stage of this rank, built once from the submodules as they are
        now (after tensor parallel and recompute have wrapped them)."""
        if self._stages is None:
            blocks = self.layout.stage_blocks()
            self._stages = [Stage(self, s, [str(i) for i in blocks[s]]) for s in self.stage_ids]
        return self._stages


class Stage(nn.Module):
    """One pipeline stage: (B, T) token ids on the first stage, (B, T, d) activations on the
    others; logits on the last."""

    def __init__(self, part: PipelinePart, index: int, blocks: list[str]) -> None:
        super().__init__()
        self.index = index
        self.first = index == 0
        self.last = index == part.layout.n_stages - 1
        self.family = part.args.family
        # The part is reached through a plain list: registering it would make its
        # parameters this stage's too.
        self._part = [part]
        if self.first:
            self.tok_embeddings = part.tok_embeddings
            if self.family == "gpt2":
                self.pos_embeddings = part.pos_embeddings
            self.dropout = part.dropout
        self.layers = nn.ModuleDict({k: part.layers[k] for k in blocks})
        if self.last:
            self.norm = part.norm
            self.output = part.output

    @property
    def d_model(self) -> int:
        """The width of the activations between stages."""
        return self._part[0].args.d_model

    def _embed(self, ids: Tensor) -> Tensor:
        """The first stage's lookups; a method of its own so that no name in ``forward``
        holds the embedding's output while the blocks run."""
        h = self.tok_embeddings(ids)
        if self.family == "gpt2":
            h = h + self.pos_embeddings(torch.arange(ids.size(1), device=ids.device))
        return self.dropout(h)

    def forward(self, x: Tensor) -> Tensor:
        with self._part[0].context():
            if self.first:
                x = self._embed(x)
            for block in self.layers.values():
                x = block(x)
            if self.last:
                x = mask_padded_vocab(self.output(self.norm(x)), self._part[0].args)
            return x


class _TiedCopySource(WeightSource):
    """The head copy of a tied embedding starts from the embedding's values."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def _name(self, name: str) -> str:
        return EMBEDDING if param_name(name) == TIED_HEAD else name

    def shape(self, name: str) -> torch.Size:
        return self.source.shape(self._name(name))

    def rows(self, name: str, start: int, stop: int, device: torch.device) -> Tensor:
        return self.source.rows(self._name(name), start, stop, device)


def part_weights(model: nn.Module, source: WeightSource) -> WeightSource:
    """The weight source for ``model``: a pipeline part reads a tied head copy from the
    embedding's values; any other model reads ``source`` as it is."""
    return model.weights(source) if isinstance(model, PipelinePart) else source
