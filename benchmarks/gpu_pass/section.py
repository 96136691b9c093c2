"""One section in its own process: ``python -m benchmarks.gpu_pass.section MODULE --json FILE
[--dry]``, MODULE the section's module (its ``run(dry) -> Result``). The runner starts this
so that a crash, a hang or an out-of-memory error in one section costs that section alone.
It names the repository files it imported, once the module is imported and again once the
section ran (``provenance.write_module_files``): the record's digest covers them."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from benchmarks.gpu_pass.provenance import write_module_files


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", help="the section's module, e.g. benchmarks.gpu_pass.attention")
    p.add_argument("--json", required=True, help="where to write the section's result")
    p.add_argument("--dry", action="store_true", help="CPU, tiny sizes")
    a = p.parse_args(argv)
    module = importlib.import_module(a.module)
    write_module_files()
    result = module.run(dry=a.dry)
    write_module_files()
    Path(a.json).write_text(json.dumps(result.to_json(), indent=1))


if __name__ == "__main__":
    main()
