"""The training loop and what it measures: trainer, checkpoints, metrics and the monitor.

May import every room below llm.run (models, data, optim, parallel, precision, recompute,
memory, runfiles, config); never llm.run or llm.launch."""
