"""Errors that carry one line naming the problem and the fix; train.py prints them without a traceback."""


class LabError(Exception):
    """Base of our one-line errors: entry points print them without a traceback."""

    exit_code = 1  # what train.py exits with


class ConfigError(LabError, ValueError):
    """An impossible or inconsistent configuration, found before any work starts."""


class DataError(LabError, RuntimeError):
    """A corpus, file or tokenizer that cannot be loaded as asked."""


class CheckpointError(LabError, RuntimeError):
    """A checkpoint that is missing, corrupt, or does not match the run."""


class TrainingError(LabError, RuntimeError):
    """Training cannot go on (a NaN loss, say); the message says why and what to change."""


class DiskFullError(LabError, OSError):
    """The run's disk is full; the message names the directory, free and needed megabytes."""


class Interrupted(LabError):
    """A signal stopped the run after its ranks checkpointed; train.py prints "stopped:"
    and exits with the shell's code for that signal (SIGINT 130, SIGTERM 143)."""

    exit_code = 130

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code
