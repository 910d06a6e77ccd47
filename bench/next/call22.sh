#!/usr/bin/env bash
# Device call 22 (gpu-next11, ~9 min): call 19's and call 20's first halves in one call: the
# qkv GEMV's rotary GPU tests (main's 4362ed5 routing, not yet on a GPU) and one token's MoE
# tests (both downs), bench/moe_layer.py's sweep of both downs, then Qwen3-30B-A3B batch 1
# against main (two rounds).
set -uo pipefail
OUT=${OUT:?}
timeout 270 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "rope_in_the_qkv or one_token" \
  > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -12
timeout 120 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/layer.txt" 2>&1
grep -E "copy|tokens 1" "$OUT/layer.txt"
timeout 150 bash bench/ab.sh .stage/base 2 "$OUT/a3b" bench latency --model qwen3-30b-a3b \
  --load-format dummy --batch-size 1 >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
