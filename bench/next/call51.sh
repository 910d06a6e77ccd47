#!/usr/bin/env bash
# Device call 51: batch-1 decode kernel traces with dependent launch ON (as the engine runs),
# FP8, INT4 (rtn) and bf16, for the critical path kernel by kernel (bench/next/trace_path.py
# here: each kernel's end after the previous one's end).
set -uo pipefail
OUT=${OUT:?}
for q in fp8 rtn none; do
  args="--batch-size 1"; [ "$q" != none ] && args="$args --quantization $q"
  timeout 200 bench/device_env.sh python3 bench/profile_decode.py $args --trace "$OUT/trace-$q.json" > "$OUT/profile-$q.txt" 2>&1
  grep -iE "step|replay" "$OUT/profile-$q.txt" | head -5
  gzip -f "$OUT/trace-$q.json"
done
ls -la "$OUT"
