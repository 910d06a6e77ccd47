#!/usr/bin/env bash
# Device call 89 (branch gpu-next23): call 88's tests again (the RoPE-in-qkv test with the
# attention kernel merging in both runs, the family test's bound at bf16 rounding), the new
# merge-against-float32 test, and a second batch-1 round main -> branch for A3B and Qwen3-8B.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=250 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "splits_merged or rope_in_the_qkv or splits_left or decode_kernel"
batch1_ab 1 qwen3-30b-a3b qwen3-8b
python3 bench/next/summary.py "$OUT"
