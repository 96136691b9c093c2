"""The training loop and what it measures: trainer, checkpoints, metrics and the monitor."""
