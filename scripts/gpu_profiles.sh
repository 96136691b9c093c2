#!/usr/bin/env bash
# The step under torch.profiler (benchmarks/profile_step), eager, at the GPU pass's speed
# shapes, before and after the fast path (issue 39): "before" is the step without the fast
# path's choices (attention=sdpa, the plain loss of fp32 logits, the unpadded vocabulary, no
# prefetch), "after" with them (attention=auto, Liger's fused loss, the vocabulary padded to
# 128, two batches read ahead). Usage, on the device, PYTHONPATH holding the GPU wheels:
#   bash scripts/gpu_profiles.sh OUT_DIR END_S
# writes OUT_DIR/profiles.tgz (each profile's report.md, profile.json, key_averages.txt and
# stdout.md; not the Chrome traces, which pass the device's 16 MiB return) and starts no
# profile past END_S seconds of the calling shell's SECONDS (export SECONDS_AT_START to
# count from the caller's start). A profile that stalls is stopped with SIGABRT, so
# Python's faulthandler writes every thread's stack into its stdout.md.
set -u
out=${1:?OUT_DIR}
end_s=${2:?END_S}
elapsed() { echo $(( SECONDS + ${SECONDS_AT_START:-0} )); }
gpt2="model=gpt2-small model.vocab_size=50257 train.micro_batch_size=16 data.seq_len=1024"
llama="model=llama-1b model.n_layers=4 model.vocab_size=128256 train.micro_batch_size=4 data.seq_len=2048"
before="attention=sdpa train.fused_loss=off model.vocab_multiple=1 data.prefetch=0"
after="attention=auto train.fused_loss=liger model.vocab_multiple=128 data.prefetch=2"
work=${TMPDIR:-/tmp}/profiles
rm -rf "$work"
declare -A most=([gpt2]=30 [llama]=50)  # seconds; llama's first call did not end in 30
for shape in gpt2 llama; do
    for when in after before; do
        left=$(( end_s - $(elapsed) ))
        limit=$(( left < ${most[$shape]} ? left : ${most[$shape]} ))
        [ "$limit" -ge 10 ] || { echo "profile $shape $when: not run, past $end_s s"; continue; }
        dir=$work/$shape-$when
        mkdir -p "$dir"
        # shellcheck disable=SC2086 # the overrides are words
        PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" python3 -m benchmarks.profile_step \
            ${!shape} ${!when} logger=none --out "$dir" > "$dir.stdout" 2>&1
        echo "profile $shape $when: exit $? ($limit s at most)"
        mv "$dir.stdout" "$dir/stdout.md"
        rm -f "$dir/trace.json"
    done
done
mkdir -p "$work"
tar czf "$out/profiles.tgz" -C "$work" .
