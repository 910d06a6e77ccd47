#!/usr/bin/env bash
# Device call 8 (gpu-next8): one token's mixture of experts as two GEMVs with the norm made in
# them, against main: the GPU tests, the layer's time and tile sweep, Qwen3-30B-A3B batch 1
# (two rounds, trees alternating).
set -uo pipefail
OUT=${OUT:?}
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py tests/gpu/test_dependent_launch_cuda.py \
  -k "one_token or qwen3-30b-a3b or mixtral or norms or chain" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -8
timeout 150 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/moe_layer.txt" 2>&1
grep -E "tokens|copy" "$OUT/moe_layer.txt" | cut -c1-200
timeout 200 bash bench/ab.sh .stage/base 2 "$OUT/a3b" bench latency --model qwen3-30b-a3b \
  --load-format dummy --batch-size 1 > "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
