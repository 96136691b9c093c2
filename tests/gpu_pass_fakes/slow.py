"""A section that finishes one row, then hangs: the runner must kill it at its limit and
keep the row."""

import time

from benchmarks.gpu_pass.common import Result, write_partial_rows


def run(dry: bool) -> Result:
    result = Result(title="slow", shapes="-", columns=["x"], rows=[{"x": 1}])
    write_partial_rows(result)
    time.sleep(600)
    return result
