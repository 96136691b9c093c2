"""One section in its own process: ``python -m benchmarks.gpu_pass.section MODULE --json FILE
[--dry]``, MODULE the section's module (its ``run(dry) -> Result``). The runner starts this
so that a crash, a hang or an out-of-memory error in one section costs that section alone."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", help="the section's module, e.g. benchmarks.gpu_pass.attention")
    p.add_argument("--json", required=True, help="where to write the section's result")
    p.add_argument("--dry", action="store_true", help="CPU, tiny sizes")
    a = p.parse_args(argv)
    result = importlib.import_module(a.module).run(dry=a.dry)
    Path(a.json).write_text(json.dumps(result.to_json(), indent=1))


if __name__ == "__main__":
    main()
