#!/usr/bin/env bash
# Device call 23 (gpu-next11, ~8 min): call 19's and call 20's second halves: the FP8-cache,
# 4-bit and kernel-shape GPU tests, Mixtral-8x7B batch 1 against main (one round, both downs'
# MoE path), Llama-3-8B 4-bit batch 1 against main (two rounds).
set -uo pipefail
OUT=${OUT:?}
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_fp8_kv_cuda.py tests/gpu/test_int4_cuda.py \
  "tests/gpu/test_triton_cuda.py::test_kernels_match_torch_at_real_shapes" > "$OUT/kernels.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernels.txt" | tail -12
timeout 150 bash bench/ab.sh .stage/base 1 "$OUT/mixtral" bench latency --model mixtral-8x7b \
  --load-format dummy --batch-size 1 >> "$OUT/log.txt" 2>&1
timeout 100 bash bench/ab.sh .stage/base 2 "$OUT/int4" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 1 --quantization rtn >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
