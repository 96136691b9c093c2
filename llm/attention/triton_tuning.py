"""The block sizes and warps that ``triton.autotune`` chose for our kernels, per tuning key.

Autotuning happens on first use of each (sequence length, head dim, causal, documents,
dtype) in a process; this reads the winners back from the autotuners so that a run or a
benchmark can record them beside the GPU's name (``benchmarks/triton_autotune.py``).
"""

from __future__ import annotations

import torch

KEY_NAMES = ("seq_len", "head_dim", "causal", "documents")


def autotuned_configs() -> list[dict]:
    """One row per (kernel, tuning key) tuned so far in this process, in tuning order.

    Rows: kernel, seq_len, head_dim, causal, documents, dtype (of q), block_m, block_n,
    num_warps, num_stages. Empty before the first call; under the interpreter every key gets
    its one fixed configuration (nothing is timed).
    """
    from llm.attention.triton_function import tuned_kernels

    rows = []
    for kernel_name, kernel in tuned_kernels().items():
        for key, config in kernel.cache.items():
            # The autotuner's key: our key arguments' values, then every tensor argument's
            # dtype in argument order (q first).
            named = dict(zip(KEY_NAMES, key[: len(KEY_NAMES)], strict=True))
            rows.append(
                {
                    "kernel": kernel_name,
                    **named,
                    "dtype": str(key[len(KEY_NAMES)]).removeprefix("torch."),
                    "block_m": config.kwargs["BLOCK_M"],
                    "block_n": config.kwargs["BLOCK_N"],
                    "num_warps": config.num_warps,
                    "num_stages": config.num_stages,
                }
            )
    return rows


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table, for docs/attention.md."""
    if not rows:
        return "(nothing autotuned in this process)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
