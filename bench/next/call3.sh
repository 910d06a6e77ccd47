#!/usr/bin/env bash
# Device call 3 (about 9 minutes): the bf16 tensor-core GEMV over 2-64 rows against cuBLAS (for
# linear.MMA_GEMV_ROWS: batch 64 is at 70.5% of floor), batch 64 against main and where its
# step goes; the LM heads in Triton against cuBLAS; the FP8 GEMM with K split from 128 rows;
# FP8 batch 8/32 against main.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 120 bench/device_env.sh python3 bench/gemv.py --rows 2 8 16 32 64 --shapes 8b-tp1-qkv \
  8b-tp1-o 8b-tp1-gate_up 8b-tp1-down > "$OUT/gemv_rows.txt" 2>&1; cat "$OUT/gemv_rows.txt"
timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b64-bf16" bench latency $L --batch-size 64 2>&1 | grep -v "^WARNING" | tail -3
timeout 80 bench/device_env.sh python3 bench/profile_decode.py --batch-size 64 --profile \
  > "$OUT/profile_b64.txt" 2>&1; tail -45 "$OUT/profile_b64.txt"
timeout 50 bench/device_env.sh python3 bench/gemv.py --shapes 8b-lm-head 30b-a3b-lm-head > "$OUT/gemv_heads.txt" 2>&1; cat "$OUT/gemv_heads.txt"
timeout 70 bench/device_env.sh python3 bench/fp8_gemm.py --rows 128 256 512 > "$OUT/fp8_gemm.txt" 2>&1; cat "$OUT/fp8_gemm.txt"
for b in 8 32; do
  timeout 80 bash bench/ab.sh .stage/base 1 "$OUT/b$b-fp8" bench latency $L --batch-size $b --quantization fp8 2>&1 | grep -v "^WARNING" | tail -3
done
