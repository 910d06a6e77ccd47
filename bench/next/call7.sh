#!/usr/bin/env bash
# Device call 7 (session 29): where Qwen3-30B-A3B's and INT4 Llama-3-8B's batch-1 steps go.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 bench/profile_decode.py --model qwen3-30b-a3b \
  --batch-size 1 --profile > "$OUT/a3b.txt" 2>&1
grep -v "^WARNING" "$OUT/a3b.txt" | cut -c1-200 | tail -60
timeout 150 bench/device_env.sh python3 bench/profile_decode.py --batch-size 1 \
  --quantization rtn --profile > "$OUT/int4.txt" 2>&1
grep -v "^WARNING" "$OUT/int4.txt" | cut -c1-200 | tail -45
