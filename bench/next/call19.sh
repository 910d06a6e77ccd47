#!/usr/bin/env bash
# Device call 19 (gpu-next10 after call 16/17, ~6 min): the qkv GEMV's RoPE + cache write
# without its 4-bit form (which lost), the attention tiles of heads of 256 over an FP8 cache
# (Gemma's 128 x 128 FP8 prompt tiles asked for 256 KB of shared memory): the GPU tests, then
# Llama-3-8B 4-bit batch 1 against main (its GEMV's split-K store now through split_k_total).
set -uo pipefail
OUT=${OUT:?}
T="bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -p no:cacheprovider"
timeout 300 $T tests/gpu/test_families_cuda.py -k "rope_in_the_qkv" > "$OUT/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -12
timeout 150 $T tests/gpu/test_fp8_kv_cuda.py tests/gpu/test_int4_cuda.py \
  "tests/gpu/test_triton_cuda.py::test_kernels_match_torch_at_real_shapes" > "$OUT/kernels.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernels.txt" | tail -12
timeout 100 bash bench/ab.sh .stage/base 2 "$OUT/int4" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 1 --quantization rtn >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
