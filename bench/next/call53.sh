#!/usr/bin/env bash
# Device call 53: the batch-1 FP8 layer chain with one layer at a time on the CUDA-core e4m3
# GEMV (bench/fp8_chain_mix.py).
set -uo pipefail
OUT=${OUT:?}
timeout 400 bench/device_env.sh python3 bench/fp8_chain_mix.py > "$OUT/mix.txt" 2>&1
cat "$OUT/mix.txt" | grep -v Warn | tail -32
