#!/usr/bin/env bash
# Device call 77: batch-1 decode traces of Qwen3-8B and Llama-3-8B (bf16, dependent launches
# on) at main after session 40's tiles, for bench/next/trace_path.py here: where Qwen3-8B's
# step (81.9% of floor) loses to Llama's (85.9%), kernel by kernel.
set -uo pipefail
OUT=${OUT:?}
for m in qwen3-8b llama-3-8b; do
  timeout 100 bench/device_env.sh python3 bench/profile_decode.py --model $m --batch-size 1 \
    --trace "$OUT/trace-$m.json" > "$OUT/profile-$m.txt" 2>&1
  grep -iE "ms/step|replay" "$OUT/profile-$m.txt" | head -3
  gzip -f "$OUT/trace-$m.json"
done
