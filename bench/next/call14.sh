#!/usr/bin/env bash
# Device call 14 (~3 min): one token's down GEMV split over the k experts (the last program of a
# row block adds the k parts): the layer and its sweep, the GPU tests, Qwen3-30B-A3B batch 1
# against main (one round).
set -uo pipefail
OUT=${OUT:?}
timeout 70 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/moe_layer.txt" 2>&1
grep -E "tokens 1" "$OUT/moe_layer.txt" | cut -c1-150
timeout 60 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "one_token" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -4
timeout 70 bash bench/ab.sh .stage/base 1 "$OUT/a3b" bench latency --model qwen3-30b-a3b \
  --load-format dummy --batch-size 1 > "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
