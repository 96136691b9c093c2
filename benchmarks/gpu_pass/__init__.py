"""The GPU pass: every GPU figure the docs list, in one or two short runs.

``python -m benchmarks.gpu_pass --part 1|2 --out DIR`` (``make gpu-pass``) runs each
section of the part in its own process, with a time limit, so a section that fails, hangs
or runs out of memory is reported and the next one still runs. ``--dry`` runs every
section's code path on the CPU at tiny sizes (a fast test in ``make test``). Sections write
rows and goals (llm-independent JSON); the runner writes ``gpu_pass.json`` and
``gpu_pass.md`` under DIR, naming the commit it ran from (``provenance``), and ``python -m
benchmarks.gpu_pass.publish`` (``make gpu-publish``) puts the tables of every record under
docs/gpu_pass/ into the docs in place of "pending".
"""

import sys
from pathlib import Path

# The benchmark scripts beside this package import each other by file name
# (``from bench_device import ...``); the sections reuse their measuring code.
_BENCHMARKS = str(Path(__file__).resolve().parent.parent)
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
