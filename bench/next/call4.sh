#!/usr/bin/env bash
# Device call 4, if time is left (about 7 minutes): where batch 64's step goes; the FP8 GEMM with
# K split from 128 rows; FP8 batch 8/32 against main.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 90 bench/device_env.sh python3 bench/profile_decode.py --batch-size 64 --profile \
  > "$OUT/profile_b64.txt" 2>&1; tail -45 "$OUT/profile_b64.txt"
timeout 80 bench/device_env.sh python3 bench/fp8_gemm.py --rows 128 256 512 > "$OUT/fp8_gemm.txt" 2>&1; cat "$OUT/fp8_gemm.txt"
for b in 8 32; do
  timeout 90 bash bench/ab.sh .stage/base 1 "$OUT/b$b-fp8" bench latency $L --batch-size $b --quantization fp8 2>&1 | grep -v "^WARNING" | tail -3
done
