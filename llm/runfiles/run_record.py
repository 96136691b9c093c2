"""The run's record of how it was started (``.hydra/config.yaml``, ``hydra.yaml``,
``overrides.yaml``), written only once the run directory's lock is held.

Hydra would write these files itself before our code runs, so a second run refused by the
lock of a live run in the same directory would first overwrite the live run's record
(experiment reports read its lr and seed there). conf/config.yaml sets
``hydra.output_subdir: null``; train.py hands the same three files to the launcher, which
writes them here after taking the lock.
"""

from __future__ import annotations

import os
from pathlib import Path

RECORD_DIR = ".hydra"


def write_run_record(run_dir: Path, record: dict[str, str] | None) -> None:
    """Write each ``{file name: text}`` of ``record`` under ``run_dir/.hydra`` (each file
    whole or not at all); None: nothing to write (a run not started by train.py)."""
    if not record:
        return
    folder = Path(run_dir) / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in record.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)
