#!/usr/bin/env bash
# Device call 3 (about 9 minutes): batch-1 bf16 with each change switched off (NORM_IN_GEMV,
# GATED_GEMV, FUSED_MERGE, LM_HEAD_GEMV), for their shares; the bf16 tensor-core GEMV over 2-64
# rows against cuBLAS (for linear.MMA_GEMV_ROWS: batch 64 is at 70.5% of floor); batch 64
# against main and where its step goes; the LM heads in Triton against cuBLAS.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
for v in no-norm no-gated no-merge no-lmhead; do
  timeout 55 bash bench/ab.sh ".stage/$v" 1 "$OUT/b1-bf16-$v" bench latency $L --batch-size 1 2>&1 | grep -v "^WARNING" | tail -3
done
timeout 110 bench/device_env.sh python3 bench/gemv.py --rows 2 8 16 32 64 --shapes 8b-tp1-qkv \
  8b-tp1-o 8b-tp1-gate_up 8b-tp1-down > "$OUT/gemv_rows.txt" 2>&1; cat "$OUT/gemv_rows.txt"
timeout 90 bash bench/ab.sh .stage/base 1 "$OUT/b64-bf16" bench latency $L --batch-size 64 2>&1 | grep -v "^WARNING" | tail -3
timeout 60 bench/device_env.sh python3 bench/gemv.py --shapes 8b-lm-head 30b-a3b-lm-head > "$OUT/gemv_heads.txt" 2>&1; cat "$OUT/gemv_heads.txt"
