#!/usr/bin/env bash
# The one prepared script for a GPU session's device call, in the order the open issues ask:
# the speed section, the nccl section, the memory estimator against the allocator (issue 42's
# single-GPU rows, now with fused AdamW), issue 42's llama3-8b rehearsals (fsdp x64, 3D x512),
# then an experiment at GPU scale. Run it on the device
# from a clean, stamped commit (here: `make gpu-stamp && make gpu-wheels`, commit nothing
# after), carrying `.whl`:
#   run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=560)
# What comes back under $OUT: the pass's gpu_pass.json/.md/.log and one tarball of the
# experiment's job records (the device returns at most 8 files, two folders deep). Commit the
# record under docs/gpu_pass/<date>-<device>-<what>/ and the experiment records with
# `python -m experiments publish DIR`, then `make gpu-publish`.
# Limits: speed 240 s + nccl 90 s + estimator 60 s + rehearse 90 s + the experiment part
# about 70 s, inside 560 s.
set -u
out=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
python3 -m benchmarks.gpu_pass --only speed,nccl,estimator,rehearse --limit speed=240 \
    --limit nccl=90 --limit estimator=60 --limit rehearse=90 --out "$out/pass"
# GPU_PART=P runs one part (`python -m experiments list --gpu` lists them); the committed
# records folder, where there is one, is resumed, so each session adds the jobs still missing.
experiment=${GPU_EXPERIMENT:-activation_recompute}
part=${GPU_PART:+part=$GPU_PART}
records=docs/experiments/${experiment}_gpu
resume=()
[ -f "$records/plan.json" ] && resume=(--resume "$records")
timeout 70 python3 -m experiments run "$experiment" scale=gpu $part logger=none \
    --out "/tmp/experiments/${experiment}_gpu" ${resume[@]+"${resume[@]}"}
tar czf "$out/experiments.tgz" -C /tmp/experiments .
