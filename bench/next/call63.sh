#!/usr/bin/env bash
# Device call 63: a trace of ten FP8 + FP8-KV decode steps at 512 rows x ~1.5k tokens (the
# 1k/1k run's), for the critical path kernel by kernel here (bench/next/trace_path.py): the
# decode kernel takes ~480 us a layer in the step against 378-394 alone (calls 60-62).
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 bench/profile_decode.py --batch-size 512 \
  --prompt-len 1500 --temperature 1.0 --quantization fp8 --kv-cache-dtype fp8 \
  --trace "$OUT/trace-512.json" > "$OUT/decode-512.txt" 2>&1
head -8 "$OUT/decode-512.txt"
gzip -f "$OUT/trace-512.json"
KVFLEET_DEPENDENT_LAUNCH=0 timeout 200 bench/device_env.sh python3 bench/profile_decode.py \
  --batch-size 512 --prompt-len 1500 --temperature 1.0 --quantization fp8 --kv-cache-dtype fp8 \
  --trace "$OUT/trace-512-nopdl.json" > "$OUT/decode-512-nopdl.txt" 2>&1
head -8 "$OUT/decode-512-nopdl.txt"
gzip -f "$OUT/trace-512-nopdl.json"
ls -la "$OUT"
