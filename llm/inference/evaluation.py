"""What a quantised model is judged on, from the run that trained it: the validation batches
the trainer used and a calibration set for AWQ (experiments/quantization.py, and
benchmarks/quantize.py beside torchao's)."""

from __future__ import annotations

import numpy as np
from omegaconf import OmegaConf

from llm.config import DataConfig
from llm.data import prepare_data
from llm.data.loader import ValLoader

# the AWQ paper calibrates on 128 x 512 tokens of the Pile; a model this size needs fewer
CALIBRATION_SEQUENCES = 64
EVAL_BATCH = 16


def evaluation_data(data: dict):
    """From a run's ``data`` config: (its tokenizer's digest, the validation loader the
    trainer used, ``CALIBRATION_SEQUENCES`` train-split sequences (N, seq_len) spread evenly
    over the split, for AWQ)."""
    cfg = DataConfig(**OmegaConf.to_container(OmegaConf.create(data), resolve=True))
    prepared = prepare_data(cfg)
    val = ValLoader(prepared.val, cfg.seq_len, cfg.packing, EVAL_BATCH, 0, 1, cfg.val_samples)
    available = prepared.train.num_samples(cfg.seq_len, True)
    n = min(CALIBRATION_SEQUENCES, available)
    indices = np.linspace(0, available - 1, n).round().astype(np.int64)
    calibration = prepared.train.batch(indices, cfg.seq_len, True).input_ids
    return prepared.tokenizer.digest, val, calibration
