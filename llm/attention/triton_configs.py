"""Block sizes and warps that ``triton.autotune`` chooses among, per kernel.

On a GPU every configuration left after pruning is timed once per tuning key (sequence
length, head dim, causal, documents, dtypes) and the fastest is kept; ``triton_tuning``
prints the winners. Under Triton's interpreter (TRITON_INTERPRET=1) timing means nothing,
so one small configuration is used: blocks of different sizes, so tests cross block edges.
"""

import triton

# (BLOCK_M, BLOCK_N) used under the interpreter, for each kernel.
INTERPRETER_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}


def _configs(*rows):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) rows -> triton Configs."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in rows
    ]


# A few configurations each, around those the public FlashAttention-2 Triton kernels use on
# A100/H100: every one is compiled for each (head dim, causal, documents, dtype), so the
# list is kept short enough that first use costs seconds, not minutes.
def fwd_configs():
    return [
        *_configs(
            (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
            (64, 64, 4, 3), (64, 32, 4, 4),
        ),
        _interpreter_config("fwd"),
    ]  # fmt: skip


def dkdv_configs():
    # BLOCK_N keys stay in registers while BLOCK_M query rows stream past: keys get the big block.
    return [
        *_configs(
            (32, 128, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2)
        ),
        _interpreter_config("dkdv"),
    ]


def dq_configs():
    return [
        *_configs(
            (128, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)
        ),
        _interpreter_config("dq"),
    ]


def _untimed(kernel_call, quantiles):
    return [0.0] * len(quantiles)


# triton.autotune's do_bench: triton's own on a GPU (None). Under the interpreter none, as
# timing means nothing there, and triton before 3.9 (3.6 under torch 2.11, 3.7 under 2.12)
# times even the one configuration _prune leaves, through a GPU driver a CPU run lacks.
DO_BENCH = _untimed if triton.knobs.runtime.interpret else None


def _interpreter_config(kernel):
    m, n = INTERPRETER_BLOCKS[kernel]
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=1, num_stages=1)


def _prune(kernel, configs, args):
    interp = _interpreter_config(kernel)
    if triton.knobs.runtime.interpret:
        return [c for c in configs if c.kwargs == interp.kwargs and c.num_warps == 1]
    tuned = [c for c in configs if c.num_warps > 1]
    if args["HEAD_DIM"] == 128:
        # 128x128 tiles with a 128-wide head need about 224 KB of shared memory at 3 stages
        # (Q, and K and V per stage): more than an A100 has, and not worth compiling to find out.
        tuned = [c for c in tuned if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] < 128 * 128]
    return tuned


def prune_fwd(configs, named_args, **kwargs):
    return _prune("fwd", configs, {**named_args, **kwargs})


def prune_dkdv(configs, named_args, **kwargs):
    return _prune("dkdv", configs, {**named_args, **kwargs})


def prune_dq(configs, named_args, **kwargs):
    return _prune("dq", configs, {**named_args, **kwargs})
