#!/usr/bin/env bash
# Device call 104 (branch gpu-next32, the form to land): the one-row 4-bit GEMV of large
# layers with whole columns to a thread, by shape (`triton_packed_rows.rows_tiles`: gate_up as
# named 4-row chunks at (256, 32, 2 warps), down as 8-row tiles at (256, 32, 1, 8); calls
# 99-103 chose them, INT4 Llama-3-8B batch 1 2.512 -> 2.321 ms in call 102). The 4-bit GPU
# tests (the INT4 family test included), the layer timings split-K / plan / the two tilings,
# then INT4 (RTN) Llama-3-8B batch 1 main -> branch, two rounds (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=200 gpu_tests tests/gpu/test_int4_cuda.py tests/gpu/test_dependent_launch_cuda.py \
  tests/gpu/test_families_cuda.py -- "w4a16 or 8_bit or gguf or chain or token_made_in_decode"
timeout 100 bench/device_env.sh python3 bench/int4_rows.py --tiles 256,32,2 256,32,1,8 \
  > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt"
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
python3 bench/next/summary.py "$OUT"
