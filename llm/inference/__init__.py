"""Sampling from what we train, and what it costs.

Which file answers what:
  load.py             a run directory, a checkpoint or an HF folder -> model + tokenizer
  kv_cache.py         the KV cache, contiguous (a row per sequence) or paged (blocks and
                      block tables, PagedAttention), and its bytes per token
  paged_attention.py  decode attention reading K/V through a block table: gather + SDPA
                      (any device), triton_paged.py (our kernel), flex_paged.py (FlexAttention)
  forward.py          the model's forward with a cache: prefill, then one token per step
  sampling.py         greedy, temperature, top-k, top-p, a generator per sequence
  engine.py           continuous batching: requests join and leave while others decode
  generate.py         prompts in, tokens and tokens/s and cache bytes out
  cli.py              python -m llm.generate's work: prompts, load, sample, generate.json
  quantize.py         INT4 weight-only linears (RTN, and AWQ's scales from awq.py)
  evaluation.py       a run's validation batches and AWQ calibration set, to judge them on

Reads checkpoints (llm.train.checkpoint_files), never the Trainer.

May import the rooms below llm.run (models, attention, data, parallel, precision, train's
checkpoint files, build, config); llm.generate and llm.estimate import it.
"""
