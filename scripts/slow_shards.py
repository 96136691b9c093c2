"""The slow suite in three named shards, for `make test-slow SHARD=NAME`.

The whole slow suite takes 49 to 69 minutes on 2 cores (README, "Tests"), too long to add to CI's
fast suite with a wide margin under its 90 minutes, so it runs apart, whole or a shard at a
time. Each shard is a list of test files (their slow tests only: the Makefile selects
`-m "slow and not gpu"`); tests/test_slow_shards.py checks that every file holding a slow
test is in exactly one shard. Minutes per shard: the sum of its files' `--durations=0`
times in one whole run (2026-11-26, 2 cores shared with other work, so upper figures). On
2026-11-28 the default suite's tests over about 12 s moved here (about 15 min more in all,
spread over the shards), to keep the default suite under 15 minutes on 2 cores.

Usage: `python scripts/slow_shards.py NAME` prints NAME's files; with no NAME, nothing (the
whole suite).
"""

from __future__ import annotations

import sys

SHARDS = {
    # Checkpoints and model-state memory: save, load, reshard, ZeRO's bytes (about 23 min).
    "checkpoints": [
        "tests/test_checkpoint_memory.py",
        "tests/test_checkpoint_layouts.py",
        "tests/test_optim_checkpoints.py",
        "tests/test_zero.py",
        "tests/test_zero_nvme.py",
        "tests/test_zero_memory.py",
        "tests/test_zero_ranks.py",
        "tests/test_build_order.py",
        "tests/test_freeze.py",
        "tests/test_overflow.py",
        "tests/test_cli.py",
        "tests/faults/test_run_faults.py",
        "tests/test_memory_peak.py",
        "tests/test_memtracker_crosscheck.py",
        "tests/test_checkpoint.py",
        "tests/test_loss_scale.py",
        "tests/faults/test_cli_edges.py",
        "tests/test_resize_patch.py",
        "tests/test_stop_latency.py",
    ],
    # Tensor, pipeline, expert and 2-D parallelism, DeepSpeed, FSDP, multi-node torchrun (about 30
    # min).
    "parallel": [
        "tests/test_pipeline.py",
        "tests/test_pipeline_dp.py",
        "tests/test_tp_dp.py",
        "tests/test_tensor_parallel.py",
        "tests/test_gpu_pass_rehearse.py",
        "tests/test_tp_dropout.py",
        "tests/test_deepspeed.py",
        "tests/test_fsdp.py",
        "tests/test_torchrun_nodes.py",
        "tests/test_expert_parallel_training.py",
        "tests/test_expert_parallel.py",
        "tests/test_expert_parallel_order.py",
        "tests/test_moe_training.py",
        "tests/test_benchmarks_pipeline.py",
        "tests/test_benchmarks_strategies.py",
        "tests/test_benchmarks_moe_peer.py",
        "tests/test_generate_layouts.py",
        "tests/test_fp8_strategies.py",
        "tests/test_gpu_pass_nccl.py",
        "tests/test_loop_collectives.py",
        "tests/test_data_per_node.py",
        "tests/test_collective_timeout.py",
        "tests/test_rehearse.py",
    ],
    # Training runs: the README's commands, optimizers under strategies, recompute (with
    # op_sac under torch 2.11: about 2 min, and 2 more to install it the first time),
    # precision, compile, the estimator and the experiments (about 27 min).
    "training": [
        "tests/test_optim_strategies.py",
        "tests/test_readme.py",
        "tests/test_slow.py",
        "tests/test_recompute_strategies.py",
        "tests/test_private_apis.py",
        "tests/test_host_reads.py",
        "tests/test_bf16_parity.py",
        "tests/test_triton_compile.py",
        "tests/test_estimate.py",
        "tests/test_estimate_single_moments.py",
        "tests/test_experiments.py",
        "tests/test_attention_backends.py",
        "tests/test_recompute.py",
        "tests/test_activation_formula.py",
        "tests/test_paged_attention.py",
        "tests/test_gpu_pass.py",
        "tests/test_gpu_pass_speed.py",
        "tests/test_calibrate.py",
        "tests/test_muon.py",
        "tests/test_precision.py",
        "tests/test_replica_precision.py",
        "tests/test_training.py",
        "tests/test_slow_shards.py",
        "tests/test_config.py",
        "tests/test_estimate_inference.py",
        "tests/test_fused_loss.py",
    ],
}


def main(argv: list[str]) -> int:
    if not argv or not argv[0]:
        return 0
    if argv[0] not in SHARDS:
        print(
            f"error: SHARD={argv[0]} is not a shard of the slow suite; use one of "
            f"{', '.join(SHARDS)}, or none for the whole suite",
            file=sys.stderr,
        )
        return 2
    print(" ".join(SHARDS[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
