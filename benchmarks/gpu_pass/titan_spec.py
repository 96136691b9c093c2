"""What torchtitan's own trainer imports for the ``speed`` section's torchtitan row, through
its supported extension points (``--experimental.custom_import`` runs this module before
the trainer builds anything):

- ``register_train_spec``: a TrainSpec named ``SPEC_NAME``, torchtitan's llama3 spec with
  one flavor, the row's shape, in place of its registry's shapes;
- its ``build_dataloader_fn``: the row's token file, batch ``i`` at step ``i``, as
  speed_rows.py feeds ours and transformers; no tokenizer;
- its ``build_metrics_processor_fn``: torchtitan's MetricsProcessor, whose metric logger (a
  ``BaseLogger``) writes each logged step's metrics dict as a JSON line, with the CUDA
  allocator's peak since torchtitan's previous log (it resets the peak after each log).

The row's settings come from the JSON file named by ``SPEC_ENV`` (titan.py writes it).
Imported only inside torchtitan's process: nothing else in the repository imports it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

from benchmarks.gpu_pass.titan import FLAVOR, SPEC_ENV, SPEC_NAME


class TokenFile(IterableDataset):
    """The row's token file as (input, label) samples in file order: with batch ``B``,
    samples ``i*B .. i*B+B-1`` make batch ``i``, the rows of speed_rows.py's ``data[i]``."""

    def __init__(self, path: str, seq_len: int):
        self.samples = np.load(path).reshape(-1, seq_len + 1)

    def __iter__(self):
        for sample in self.samples:
            ids = torch.from_numpy(sample)
            yield {"input": ids[:-1]}, ids[1:]


class JsonLinesLogger(BaseLogger):
    """torchtitan's metrics dict of each logged step, one JSON object a line."""

    def __init__(self, path: str):
        self.path = path

    def log(self, metrics: dict, step: int) -> None:
        record = {"step": step, **metrics}
        if torch.cuda.is_available():
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _spec() -> dict:
    with open(os.environ[SPEC_ENV]) as f:
        return json.load(f)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **_):
    spec = _spec()
    return ParallelAwareDataloader(
        TokenFile(spec["tokens_path"], job_config.training.seq_len),
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=job_config.training.local_batch_size,
    )


def build_metrics(job_config, parallel_dims, model_args=None, tag=None) -> MetricsProcessor:
    processor = MetricsProcessor(job_config, parallel_dims, tag)
    processor.logger = JsonLinesLogger(_spec()["metrics_path"])
    return processor


def register() -> None:
    spec = get_train_spec()
    spec.model_args = {FLAVOR: TransformerModelArgs(**_spec()["model"])}
    spec.build_dataloader_fn = build_dataloader
    spec.build_tokenizer_fn = None
    spec.build_validator_fn = None
    spec.build_metrics_processor_fn = build_metrics
    register_train_spec(SPEC_NAME, spec)


register()
