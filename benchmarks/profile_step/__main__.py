"""The command line: ``python -m benchmarks.profile_step [--out DIR] [--warmup N]
[--steps N] [--record-shapes] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm.errors import LabError

from . import profile_step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    parser.add_argument("--out", type=Path, help="default outputs/profile_step/<name>")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--record-shapes", action="store_true")
    args = parser.parse_args(argv)
    try:
        _, text = profile_step(
            args.overrides, args.out, args.warmup, args.steps, args.record_shapes
        )
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
