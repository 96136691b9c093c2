"""The run's files and the checks on them: the run directory's lock, its record (.hydra/),
checksums, free disk space, and train.py's preflight (override keys, disk) before Hydra
makes the folder. Imports llm.config and llm.errors only; data, train, logging, run and
launch import it."""
