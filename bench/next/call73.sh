#!/usr/bin/env bash
# Device call 73 (after gpu-next19's one-token MoE landed): batch-1 decode traces of
# Qwen3-30B-A3B and Mixtral-8x7B with dependent launches on (as the engine runs), for the
# critical path kernel by kernel (bench/next/trace_path.py here, on the gzipped traces).
set -uo pipefail
OUT=${OUT:?}
for m in qwen3-30b-a3b mixtral-8x7b; do
  timeout 240 bench/device_env.sh python3 bench/profile_decode.py --model $m --batch-size 1 \
    --trace "$OUT/trace-$m.json" > "$OUT/profile-$m.txt" 2>&1
  grep -iE "step|replay" "$OUT/profile-$m.txt" | head -5
  gzip -f "$OUT/trace-$m.json"
done
ls -la "$OUT"
