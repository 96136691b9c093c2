"""Block sizes and warps that ``triton.autotune`` chooses among, per kernel.

On a GPU every configuration left after pruning is timed once per tuning key (sequence
length, head dim, causal, documents, dtypes) and the fastest is kept; ``triton_tuning``
prints the winners. Under Triton's interpreter (TRITON_INTERPRET=1) timing means nothing, so one
small configuration is used: blocks of different sizes, so that tests cross block edges.
"""

from itertools import product

import triton

# (BLOCK_M, BLOCK_N) used under the interpreter, for each kernel.
INTERPRETER_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}


def _configs(block_m, block_n, warps, stages):
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in product(block_m, block_n, warps, stages)
    ]


def fwd_configs():
    return [*_configs((64, 128), (32, 64, 128), (4, 8), (3, 4)), _interpreter_config("fwd")]


def dkdv_configs():
    # BLOCK_N keys stay in registers while BLOCK_M query rows stream past: keys get the big block.
    return [*_configs((32, 64), (64, 128), (4, 8), (2, 3)), _interpreter_config("dkdv")]


def dq_configs():
    return [*_configs((64, 128), (32, 64), (4, 8), (2, 3)), _interpreter_config("dq")]


def _interpreter_config(kernel):
    m, n = INTERPRETER_BLOCKS[kernel]
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=1, num_stages=1)


def _prune(kernel, configs, args):
    interp = _interpreter_config(kernel)
    if triton.knobs.runtime.interpret:
        return [c for c in configs if c.kwargs == interp.kwargs and c.num_warps == 1]
    tuned = [c for c in configs if c.num_warps > 1]
    if args["HEAD_DIM"] == 128:
        # Two 128x128 tiles plus K/V stages do not fit in shared memory next to a 128-wide Q.
        tuned = [c for c in tuned if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] < 128 * 128]
    return tuned


def prune_fwd(configs, named_args, **kwargs):
    return _prune("fwd", configs, {**named_args, **kwargs})


def prune_dkdv(configs, named_args, **kwargs):
    return _prune("dkdv", configs, {**named_args, **kwargs})


def prune_dq(configs, named_args, **kwargs):
    return _prune("dq", configs, {**named_args, **kwargs})
