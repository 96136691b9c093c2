"""Launching: the launcher that spawns local ranks or joins torchrun / Slurm / deepspeed
(launcher.py), the agent watch, Slurm requeue on preemption, rank failure records, and the
lines train.py prints at a run's end. The top room: may import every other room; none
imports it but train.py, experiments/, benchmarks/ and tests."""
