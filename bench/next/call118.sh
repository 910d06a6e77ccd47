#!/usr/bin/env bash
# Device call 118 (session 46): call 113 found Llama-3.2-1B batch 1 slower with
# `triton_gemv.WIDE_BF16` on (1.47 / 1.58 ms against 0.95 / 1.11 off; every other shape faster
# or even). Which layer: a batch-1 trace with it on (main) and off, and its bf16 layers alone at
# 8 x 512 and 8 x 1,024 (qkv 3,072 x 2,048 and down 2,048 x 8,192 take it; o preloads).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
batch1_trace llama-3.2-1b
mv "$OUT/trace-llama-3.2-1b.json.gz" "$OUT/trace-wide.json.gz"
mv "$OUT/profile-llama-3.2-1b.txt" "$OUT/profile-wide.txt"
sed -i 's/^WIDE_BF16 = True/WIDE_BF16 = False/' engine/layers/triton_gemv.py
grep -n "^WIDE_BF16" engine/layers/triton_gemv.py
batch1_trace llama-3.2-1b
mv "$OUT/trace-llama-3.2-1b.json.gz" "$OUT/trace-narrow.json.gz"
mv "$OUT/profile-llama-3.2-1b.txt" "$OUT/profile-narrow.txt"
tail -3 "$OUT"/profile-*.txt
timeout 120 bench/device_env.sh python3 bench/gemv.py --methods triton \
  --shapes 1b-qkv 1b-o 1b-down 8b-tp1-o --tiles 8,512,4,3 8,1024,4,3 2>&1 | tail -6
