#!/usr/bin/env bash
# Device call 66: the bf16 side of the 1k/1k breakdown (call 59 has FP8's): a prompt step of
# 8 x 1,024 and a decode step of 256 rows at ~1.5k tokens (temperature 1), each profiled.
set -uo pipefail
OUT=${OUT:?}
timeout 150 bench/device_env.sh python3 bench/profile_prefill.py > "$OUT/prefill-bf16.txt" 2>&1
timeout 200 bench/device_env.sh python3 bench/profile_decode.py --batch-size 256 \
  --prompt-len 1500 --temperature 1.0 --trace "$OUT/trace-bf16-256.json" > "$OUT/decode-bf16-256.txt" 2>&1
gzip -f "$OUT/trace-bf16-256.json"
grep -E "prompt tokens a step|ms/step|graph replay|LM head" "$OUT"/*.txt
