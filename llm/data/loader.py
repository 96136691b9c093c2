"""Training and validation loaders over a TokenDataset, sharded by data-parallel rank.

Every rank walks the same global order. At each micro-step the global micro-batch is
order[pos : pos + B*dp_size]; rank r takes its slice [r*B : (r+1)*B]; pos += B*dp_size.
So dp_size ranks with B each see exactly the samples one process with B*dp_size sees, and
k micro-batches of B see what one batch of k*B sees. The training order is a fresh
permutation per epoch from numpy's Generator(seed + epoch); the state is the global
position, so a run can resume on a different number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from llm.data.dataset import IGNORE, Batch, TokenDataset
from llm.errors import DataError


def check_shard(
    split: str, n_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> None:
    if not 0 <= dp_rank < dp_size:
        raise DataError(
            f"dp_rank={dp_rank} is outside dp_size={dp_size}; pass 0 <= dp_rank < dp_size"
        )
    if n_samples < micro_batch_size * dp_size:
        raise DataError(
            f"the {split} split has {n_samples} samples, fewer than one global micro-batch "
            f"(micro_batch_size={micro_batch_size} x dp_size={dp_size}); use a bigger corpus or "
            "smaller data.seq_len / train.micro_batch_size (or data.val_fraction for val)"
        )


class TrainLoader:
    """An endless iterator of Batch; state_dict()/load_state_dict() resume it exactly."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        packing: bool,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.dataset, self.seq_len, self.packing = dataset, seq_len, packing
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.num_samples = dataset.num_samples(seq_len, packing)
        check_shard("train", self.num_samples, micro_batch_size, dp_rank, dp_size)
        self.seed = seed
        self.epoch = 0
        self.position = 0  # samples of this epoch's permutation consumed by all ranks together
        self._order: np.ndarray | None = None  # the permutation of self.epoch, made on demand

    def _permutation(self) -> np.ndarray:
        if self._order is None:
            self._order = np.random.default_rng(self.seed + self.epoch).permutation(
                self.num_samples
            )
        return self._order

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        global_batch = self.micro_batch_size * self.dp_size
        if self.position + global_batch > self.num_samples:
            # The incomplete tail is dropped, so every micro-batch is full on every rank.
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        start = self.position + self.dp_rank * self.micro_batch_size
        indices = self._permutation()[start : start + self.micro_batch_size]
        self.position += global_batch
        return self.dataset.batch(indices, self.seq_len, self.packing)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["position"] <= self.num_samples:
            raise DataError(
                f"the saved loader position {state['position']} does not fit this train split "
                f"({self.num_samples} samples); resume with the same data config or checkpoint.resume=none"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = None


class ValLoader:
    """``n_samples`` samples spread evenly over the split (every file is represented, not
    just the first few), the same set whatever the micro-batch size and dp size, so
    validation losses compare across a sweep; re-iterable.

    Every rank runs the same number of micro-batches (collectives inside a sharded forward
    must match up): the last global micro-batch is filled with rows whose targets are all
    IGNORE, which add nothing to the loss sum or the token count.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        packing: bool,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        n_samples: int,
    ) -> None:
        self.dataset, self.seq_len, self.packing = dataset, seq_len, packing
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        available = dataset.num_samples(seq_len, packing)
        if available == 0:
            raise DataError(
                f"the val split has no sample of data.seq_len={seq_len}; raise data.val_fraction "
                "or lower data.seq_len"
            )
        self.n_samples = min(n_samples, available)
        # Evenly strided sample indices; all of them when the split is small.
        self.indices = np.linspace(0, available - 1, self.n_samples).round().astype(np.int64)
        self.n_batches = math.ceil(self.n_samples / (micro_batch_size * dp_size))

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> Iterator[Batch]:
        b = self.micro_batch_size
        for step in range(self.n_batches):
            start = step * b * self.dp_size + self.dp_rank * b
            real = self.indices[start : start + b]
            yield self._padded(real, b - len(real))

    def _padded(self, indices: np.ndarray, n_pad: int) -> Batch:
        if n_pad == 0:
            return self.dataset.batch(indices, self.seq_len, self.packing)
        pad_inputs = torch.zeros(n_pad, self.seq_len, dtype=torch.long)
        pad_targets = torch.full((n_pad, self.seq_len), IGNORE, dtype=torch.long)
        # A padding row is one document (it has no target, so it never reaches the loss).
        pad_docs = torch.zeros(n_pad, self.seq_len, dtype=torch.int32) if self.packing else None
        if len(indices) == 0:
            return Batch(pad_inputs, pad_targets, pad_docs)
        real = self.dataset.batch(indices, self.seq_len, self.packing)
        docs = None if pad_docs is None else torch.cat([real.doc_ids, pad_docs])
        return Batch(
            torch.cat([real.input_ids, pad_inputs]), torch.cat([real.targets, pad_targets]), docs
        )
