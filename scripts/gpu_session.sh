#!/usr/bin/env bash
# The one prepared script for a GPU session's device call, in the order the open issues ask:
# the speed section (issue 39), the nccl section, the memory estimator against the allocator
# (issue 42's single-GPU rows), issue 42's llama3-8b rehearsals (fsdp x64, 3D x512), the
# step's profile before and after the fast path (issue 39), then, with EXPERIMENT_S=N, an
# experiment at GPU scale (issue 44). Run it on the device from a clean, stamped
# commit (here: `make gpu-stamp && make gpu-wheels`, commit nothing after), carrying `.whl`:
#   run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=595)
# What comes back under $OUT: the pass's gpu_pass.json/.md/.log, profiles.tgz (each
# profile's report and profile.json; not the Chrome traces, which pass the return's 16 MiB)
# and experiments.tgz (the experiment's job records). Commit the pass's record under
# docs/gpu_pass/<date>-<device>-<what>/, the profiles beside it, and the experiment records
# with `python -m experiments publish DIR`, then `make gpu-publish`.
# Limits: speed 245 s, nccl 80 s, estimator 55 s, rehearse 80 s, then the four profiles
# (30 s each for gpt2-small, 50 for llama-1b, at most) up to 585 s from the start;
# EXPERIMENT_S=N (default 0) adds the experiment.
set -u
out=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
python3 -m benchmarks.gpu_pass --only speed,nccl,estimator,rehearse --limit speed=245 \
    --limit nccl=80 --limit estimator=55 --limit rehearse=80 --out "$out/pass"

# The step's profile before and after the fast path (scripts/gpu_profiles.sh).
SECONDS_AT_START=$SECONDS bash scripts/gpu_profiles.sh "$out" 585

experiment_s=${EXPERIMENT_S:-0}
[ "$experiment_s" -gt 0 ] || exit 0
# GPU_PART=P runs one part (`python -m experiments list --gpu` lists them); the committed
# records folder, where there is one, is resumed, so each session adds the jobs still missing.
experiment=${GPU_EXPERIMENT:-activation_recompute}
part=${GPU_PART:+part=$GPU_PART}
records=docs/experiments/${experiment}_gpu
exp_resume=()
[ -f "$records/plan.json" ] && exp_resume=(--resume "$records")
timeout "$experiment_s" python3 -m experiments run "$experiment" scale=gpu $part logger=none \
    --out "/tmp/experiments/${experiment}_gpu" ${exp_resume[@]+"${exp_resume[@]}"}
tar czf "$out/experiments.tgz" -C /tmp/experiments .
