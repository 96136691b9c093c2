"""The CUDA tests: ``pytest -m gpu``, all of them, one row per test with its outcome.

The dry run collects them instead (they need a GPU to run), so a test that no longer
imports or collects is caught on CPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_pass.common import Goal, Result, earlier_rows, write_partial_rows

REPO = Path(__file__).resolve().parents[2]
PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider"]


# pytest -v's line per test, and -rA's summary line per test with its reason.
RESULT_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)(?: - (.*))?")


def _run_tests() -> list[dict]:
    """Run the tests, reading pytest's lines as they come, so that a section cut short by
    its time limit keeps every test that finished; the rest stay "not run". A test an
    earlier call on this device passed (``--resume``) keeps its row and is not run again."""
    rows = {r["test"]: {**r, "outcome": "not run"} for r in _collect()}
    passed = {
        r["test"]: {**r, "message": "passed in an earlier call on this device"}
        for r in earlier_rows()
        if r["outcome"] == "passed" and r["test"] in rows
    }
    rows.update(passed)
    if len(passed) == len(rows):
        return list(rows.values())
    deselect = [arg for test in passed for arg in ("--deselect", test)]
    proc = subprocess.Popen(
        [*PYTEST, "-v", "-rA", *deselect], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        print(line, end="", flush=True)
        if found := RESULT_LINE.match(line):
            test, outcome = found.groups()
            rows[test] = {"test": test, "outcome": outcome.lower(), "message": ""}
            write_partial_rows(_result(list(rows.values()), dry=False))
        elif (found := SUMMARY_LINE.match(line)) and found.group(2) in rows:
            rows[found.group(2)]["message"] = (found.group(3) or "")[:160]
    proc.wait()
    return list(rows.values())


def _collect() -> list[dict]:
    done = subprocess.run(
        [*PYTEST, "-q", "--collect-only"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"pytest -m gpu --collect-only failed:\n{done.stdout}{done.stderr}")
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    return [{"test": i, "outcome": "collected", "message": ""} for i in ids]


def _goal(rows: list[dict], dry: bool) -> Goal:
    """Every collected test passed (one not reached counts against it); not measured with
    no test."""
    name, target = "the CUDA tests pass", "every test passes"
    if not rows:
        return Goal.unmeasured(name, target)
    if dry:
        return Goal(name, target, f"{len(rows)} collected (not run: no GPU)", None)
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "skipped", "not run")}
    bad = sum(r["outcome"] in ("failed", "error") for r in rows)
    value = (
        f"{count['passed']} passed, {bad} failed, {count['skipped']} skipped, "
        f"{count['not run']} not reached"
    )
    return Goal(name, target, value, count["passed"] == len(rows))


def _result(rows: list[dict], dry: bool) -> Result:
    return Result(
        title="pytest -m gpu",
        shapes="the tests' own",
        columns=["test", "outcome", "message"],
        rows=rows,
        goals=[_goal(rows, dry)],
    )


def run(dry: bool) -> Result:
    rows = _collect() if dry else _run_tests()
    if not rows:
        raise SystemExit("pytest -m gpu found no tests")
    return _result(rows, dry)
