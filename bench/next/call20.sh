#!/usr/bin/env bash
# Device call 20 (gpu-next11, ~9 min): one token's MoE down over all k experts a program
# (`triton_moe_gemv.DOWN_ALL_CHOICES`) against down split over them: GPU tests, the layer
# alone across tiles (bench/moe_layer.py), then Qwen3-30B-A3B batch 1 against main (two
# rounds) and Mixtral-8x7B (one).
set -uo pipefail
OUT=${OUT:?}
timeout 150 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "one_token" > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -8
timeout 150 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/layer.txt" 2>&1
grep -E "copy|tokens 1" "$OUT/layer.txt"
L="--load-format dummy --batch-size 1"
timeout 120 bash bench/ab.sh .stage/base 2 "$OUT/a3b" bench latency --model qwen3-30b-a3b $L \
  >> "$OUT/log.txt" 2>&1
timeout 150 bash bench/ab.sh .stage/base 1 "$OUT/mixtral" bench latency --model mixtral-8x7b $L \
  >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
