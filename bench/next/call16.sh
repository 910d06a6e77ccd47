#!/usr/bin/env bash
# Device call 16 (gpu-next10, ~7 min): the GPU tests of one token's RoPE (with Qwen3's and
# Gemma 3's q/k norms) and cache write made by the qkv GEMV: batch-1 tokens and logprobs with
# and without it at Llama, Qwen2, Phi-3, Gemma 2, Qwen3 and Gemma 3 shapes in bf16, and Llama
# and Qwen3 with FP8 and 4-bit weights, bf16 and FP8 caches; the kernel tests it touches.
set -uo pipefail
OUT=${OUT:?}
timeout 420 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "rope_in_the_qkv" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -8
timeout 150 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_int4_cuda.py tests/gpu/test_fp8_cuda.py \
  tests/gpu/test_dependent_launch_cuda.py -k "not smollm2" > "$OUT/kernels.txt" 2>&1
tail -2 "$OUT/kernels.txt"
