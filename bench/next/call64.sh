#!/usr/bin/env bash
# Device call 64: the FP8 decode kernel on the engine's own inputs at 512 x ~1.5k, and with each
# input replaced by a bench-made one (bench/next/attention_in_engine.py).
set -uo pipefail
OUT=${OUT:?}
timeout 400 bench/device_env.sh python3 bench/next/attention_in_engine.py --batch-size 512 \
  --prompt-len 1500 > "$OUT/inplace.txt" 2>&1
grep -v "tensors/s" "$OUT/inplace.txt" | tail -20
