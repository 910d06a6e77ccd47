#!/usr/bin/env bash
# Device call 3 (about 9 minutes): FP8 batch 8/32 and bf16 batch 64 against main; the FP8
# GEMM with K split against cuBLASLt from 128 rows; the LM heads' one-row product in Triton
# against cuBLAS; where the FP8 1k/1k decode step goes.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
for b in 8 32; do
  timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b$b-fp8" bench latency $L --batch-size $b --quantization fp8 2>&1 | grep -v "^WARNING" | tail -3
done
timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b64-bf16" bench latency $L --batch-size 64 2>&1 | grep -v "^WARNING" | tail -3
timeout 60 bench/device_env.sh python3 bench/gemv.py --shapes 8b-tp1-qkv 8b-tp1-gate_up 8b-lm-head 30b-a3b-lm-head > "$OUT/gemv.txt" 2>&1; cat "$OUT/gemv.txt"
timeout 80 bench/device_env.sh python3 bench/fp8_gemm.py --rows 128 256 512 > "$OUT/fp8_gemm.txt" 2>&1; cat "$OUT/fp8_gemm.txt"
timeout 110 bench/device_env.sh python3 bench/profile_decode.py --batch-size 256 --prompt-len 1536 \
  --quantization fp8 --kv-cache-dtype fp8 --profile > "$OUT/profile_decode.txt" 2>&1; tail -60 "$OUT/profile_decode.txt"
