"""The device a benchmark runs on, shared by the benchmark scripts."""

import torch


def bench_device(requested: str) -> str:
    """``auto`` -> cuda when torch sees a GPU, else cpu; ``cuda`` without one is refused."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; use --device cpu")
    return requested
