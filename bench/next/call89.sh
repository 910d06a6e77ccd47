#!/usr/bin/env bash
# Device call 89 (branch gpu-next23): call 88's tests again (the RoPE-in-qkv test with the
# attention kernel merging in both runs, the family test's bound at bf16 rounding), the new
# merge-against-float32 test, and a second batch-1 round main -> branch for A3B and Qwen3-8B.
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
timeout 250 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py \
  -k "splits_merged or rope_in_the_qkv or splits_left or decode_kernel" > "$OUT/tests.txt" 2>&1
grep -aE "^FAILED|passed|failed|error" "$OUT/tests.txt" | tail -12
for m in qwen3-30b-a3b qwen3-8b; do
  timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/$m" bench latency --model $m $A \
    > "$OUT/ab-$m.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
