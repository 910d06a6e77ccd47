#!/usr/bin/env bash
# Device call 99 (branch gpu-next32): the one-row 4-bit GEMV with whole columns to a thread
# (`triton_packed_rows`: 3.45 SASS instructions a weight against the shipped kernel's 5.3,
# offline sm_90 compile). GPU tests of the 4-bit paths (the new kernel is the default one-row
# 4-bit bf16 GEMV on this branch), the layer sweep at Llama-3-8B's shapes (bench/int4_rows.py),
# then INT4 (RTN) Llama-3-8B batch 1 main -> branch, two rounds (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=200 gpu_tests tests/gpu/test_int4_cuda.py tests/gpu/test_dependent_launch_cuda.py \
  tests/gpu/test_families_cuda.py -- "w4a16 or 8_bit or gguf or chain or token_made_in_decode"
timeout 200 bench/device_env.sh python3 bench/int4_rows.py > "$OUT/int4_rows.txt" 2>&1
cat "$OUT/int4_rows.txt" | tr '|' '\n' | head -80
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
python3 bench/next/summary.py "$OUT"
