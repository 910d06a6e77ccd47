#!/usr/bin/env bash
# Device call 132 (session 49): the tree as committed, `triton_gemv.FP8_BF16_ROW` on: the GPU
# tests it touches (FP8 splits merged by o, rotary qkv, decode graphs, fused GEMV, layer chain,
# the norms tests, the layer tests) (~4 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=${TEST_LIMIT:-280} gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_fp8_cuda.py \
  tests/gpu/test_dependent_launch_cuda.py -- "(splits_merged_by_the_o_gemv and fp8) or \
(rope_in_the_qkv and fp8) or decode_graphs or fused_gemv or layer_chain or norms_made_in_the_gemvs \
or norms_in_the_gemvs or layer_matches"
grep -aE "^E  " "$OUT/tests.txt" | head -8
