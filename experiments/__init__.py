"""Experiments: published claims tested with one command each (docs/experiments.md).

Each experiment is a Hydra sweep (conf/experiment/<name>.yaml, <name>_gpu.yaml for the
GPU scale, and <name>_medium.yaml for a longer CPU run where one exists), a module here
holding its claims as data and turning the sweep's jobs into tables and plots, and a
report. This package imports llm/; llm/ never imports it.
"""
