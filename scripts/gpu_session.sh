#!/usr/bin/env bash
# The prepared script for a GPU session's device calls, in the order the open issues ask.
# A session has 15 minutes of device time and one call runs 10 at most, so it is two calls:
#   PART=1 (default): the speed section (issue 39, 330 s), then the step's profiles before
#     and after the fast path (issue 39, scripts/gpu_profiles.sh) up to 545 s from the start;
#   PART=2: the llama3-8b rehearsals (issue 42, 75 s), the estimator section (issue 42's
#     single-GPU rows, 80 s), then train.py's own Trainer on gpt2-small 16 x 1024, compiled
#     in each of TRAINER_MODES (default "default reduce-overhead"; issue 39's compile modes
#     and data_wait_share; 55 s each, none started past 205 s: summary.json and the log
#     back as trainer-MODE.json/.log), then with EXPERIMENT_S=N an experiment at GPU scale
#     (issue 44).
# The nccl section has a record (2026-11-28); add it back with EXTRA=nccl=80. RESUME=DIR (a
# committed record of the same device, e.g. docs/gpu_pass/2026-11-28-h200-session7) keeps
# its rows of every section whose files are unchanged since, and measures the rest.
# Run from a clean, stamped commit (here: `make gpu-stamp && make gpu-wheels`, commit
# nothing after), carrying `.whl`:
#   run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=555)
#   run(command="PART=2 bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=270)
# (555 + 270 s and two starts, about 30 s each, fit a session's 900 s of device time;
# EXPERIMENT_S=N adds an experiment to PART=2 where more is left.)
# What comes back under $OUT: the pass's gpu_pass.json/.md/.log, profiles.tgz (each
# profile's report and profile.json; not the Chrome traces, which pass the return's 16 MiB)
# and experiments.tgz (the experiment's job records). Commit the pass's record under
# docs/gpu_pass/<date>-<device>-<what>/, the profiles beside it, and the experiment records
# with `python -m experiments publish DIR`, then `make gpu-publish`.
set -u
out=${OUT:?the device tool sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
extra=${EXTRA:+,${EXTRA%%=*}}
limits=()
[ -n "${EXTRA:-}" ] && limits=(--limit "$EXTRA")
[ -n "${RESUME:-}" ] && limits+=(--resume "$RESUME")
if [ "${PART:-1}" = 1 ]; then
    python3 -m benchmarks.gpu_pass --only "speed$extra" --limit speed=330 \
        ${limits[@]+"${limits[@]}"} --out "$out/pass"
    SECONDS_AT_START=$SECONDS bash scripts/gpu_profiles.sh "$out" 545
    exit 0
fi
python3 -m benchmarks.gpu_pass --only "rehearse,estimator$extra" --limit rehearse=75 \
    --limit estimator=80 ${limits[@]+"${limits[@]}"} --out "$out/pass"

# The fast path in the Trainer itself: its loader (data_wait_share), fused AdamW, the
# padded head and the compiled model and loss, timed by the Trainer's own timed steps.
for mode in ${TRAINER_MODES-default reduce-overhead}; do
    [ "$SECONDS" -le 205 ] || { echo "trainer $mode: not run, past 205 s"; continue; }
    run=/tmp/trainer-$mode
    timeout 55 python3 train.py model=gpt2-small model.vocab_size=50257 \
        model.vocab_multiple=128 data.seq_len=1024 train.micro_batch_size=16 \
        train.compile=true train.compile_mode="$mode" train.max_steps=40 train.log_every=10 \
        train.eval_every=1000 checkpoint.enabled=false logger=none output_dir="$run" \
        > "$out/trainer-$mode.log" 2>&1
    echo "trainer $mode: exit $?"
    cp "$run/summary.json" "$out/trainer-$mode.json" 2>/dev/null
done

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
