#!/usr/bin/env bash
# Device call 56: batch-1 decode attention with each split's first tile of earlier tokens
# loaded before the dependent-launch wait (triton_decode.PRELOAD_FIRST_TILE): GPU tests, then
# batch 1 bf16 (two rounds) and FP8 weights (one) against main (.stage/base).
set -uo pipefail
OUT=${OUT:?}
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_triton_cuda.py tests/gpu/test_dependent_launch_cuda.py -k "decode or dependent or graph" > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
L="--model llama-3-8b --load-format dummy --batch-size 1"
timeout 200 bash bench/ab.sh .stage/base 2 "$OUT/bf16" bench latency $L > "$OUT/ab-bf16.txt" 2>&1
timeout 120 bash bench/ab.sh .stage/base 1 "$OUT/fp8" bench latency $L --quantization fp8 > "$OUT/ab-fp8.txt" 2>&1
for f in "$OUT"/bf16/*.json "$OUT"/fp8/*.json; do
  python3 -c "import json,sys; d=json.load(open('$f')); print('$f'.split('/')[-2:], d.get('decode_ms_per_token'), d.get('pct_of_floor'))"
done
