#!/usr/bin/env bash
# Device call 84 (branch gpu-next22, to land): the GPU attention, dependent-launch and GEMV tests,
# then batch 1 against main (.stage/base) for Llama-3-8B, Qwen3-8B and Qwen3-30B-A3B: decode
# attention's splits of at least 64 keys (one tile, preloaded), preloaded up to two programs an
# SM, this step's K and V loaded with q; the prompt kernel's splits still at least 128 keys.
# `bash bench/next/stage.sh` here first; carry .whl and .stage. ~5 min.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_triton_cuda.py tests/gpu/test_fp8_kv_cuda.py \
  tests/gpu/test_dependent_launch_cuda.py -k "decode or e4m3 or graph or gemv or split" \
  > "$OUT/tests.txt" 2>&1
grep -aE "passed|failed|error" "$OUT/tests.txt" | tail -3
for m in llama-3-8b qwen3-8b qwen3-30b-a3b; do
  timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/$m" bench latency --model $m \
    --load-format dummy --batch-size 1 > "$OUT/ab-$m.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
