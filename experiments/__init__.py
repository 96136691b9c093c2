"""Experiments: published claims tested with one command each (docs/experiments.md).

Each experiment is a Hydra sweep (conf/experiment/<name>.yaml, and <name>_gpu.yaml for the
GPU scale), a module here holding its claims as data and turning the sweep's jobs into
tables and plots, and a report. This package imports llm/; llm/ never imports it.
"""
