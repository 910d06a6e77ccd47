#!/usr/bin/env bash
# Device call 128 (session 48): e4m3 weights at one row times the row as it is (W8A16,
# `triton_gemv.FP8_BF16_ROW`: no quantized row, the bf16 plans, decode attention's splits merged
# by o) and the one-row GEMV's sums grouped 16 bytes a thread (`GROUPED_SUMS`: registers 117 ->
# 56 at bf16 8 x 1,024): alone (bench/fp8_gemv.py, bench/gemv.py), then batch 1 (FP8 Llama-3-8B;
# bf16 Llama-3-8B and Qwen3-30B-A3B) main against each (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
timeout 120 bench/device_env.sh python3 bench/fp8_gemv.py --bf16-row --grouped --mma --tiles \
  8,1024,4,3 8,2048,4,3 16,1024,4,3 8,4096,4,3 > "$OUT/fp8_bf16_row.txt" 2>&1
tail -5 "$OUT/fp8_bf16_row.txt"
shapes="8b-tp1-qkv 8b-tp1-o 8b-tp1-gate_up 8b-tp1-down 30b-a3b-qkv 30b-a3b-o"
# shellcheck disable=SC2086
timeout 90 bench/device_env.sh python3 bench/gemv.py --methods triton --shapes $shapes \
  --tiles 8,2048,4,3 16,1024,4,3 > "$OUT/gemv_plain.txt" 2>&1
# shellcheck disable=SC2086
timeout 90 bench/device_env.sh python3 bench/gemv.py --methods triton --shapes $shapes \
  --grouped --tiles 8,2048,4,3 16,1024,4,3 > "$OUT/gemv_grouped.txt" 2>&1
tail -7 "$OUT/gemv_plain.txt" "$OUT/gemv_grouped.txt"
G=engine/layers/triton_gemv.py
variant row $G FP8_BF16_ROW
variant rowg $G FP8_BF16_ROW $G GROUPED_SUMS
variant rowgw $G FP8_BF16_ROW $G GROUPED_SUMS $G FP8_ROW_WIDE
variant g $G GROUPED_SUMS
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 1 llama-3-8b .stage/base /tmp/var/row \
  /tmp/var/rowg /tmp/var/rowgw
batch1_variants 1 llama-3-8b .stage/base /tmp/var/g
batch1_variants 1 qwen3-30b-a3b .stage/base /tmp/var/g
python3 bench/next/summary.py "$OUT"
