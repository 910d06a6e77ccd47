#!/usr/bin/env bash
# Device call 131 (session 48): `triton_gemv.FP8_BF16_ROW` on in this copy: its GPU test against
# the FP8 run's weights dequantized in bf16, the norms test (near ties under W8A16), the layer
# tests; then FP8 batch 1 main against FP8_BF16_ROW, with FP8_ROW_WIDE (8-row plans: o, down) and
# with FP8_ROW_WIDE_SIXTEEN too (Llama-3-8B two rounds, Qwen3-8B one) (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
G=engine/layers/triton_gemv.py
variant row $G FP8_BF16_ROW
variant wide $G FP8_BF16_ROW $G FP8_ROW_WIDE
variant all $G FP8_BF16_ROW $G FP8_ROW_WIDE $G FP8_ROW_WIDE_SIXTEEN
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 2 llama-3-8b .stage/base /tmp/var/row \
  /tmp/var/wide /tmp/var/all
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 1 qwen3-8b .stage/base /tmp/var/row \
  /tmp/var/wide /tmp/var/all
python3 bench/next/summary.py "$OUT"
flag_on $G FP8_BF16_ROW
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_fp8_cuda.py -- \
  "fp8_rows_taken or norms_in_the_gemvs or layer_matches"
grep -aE "^E  " "$OUT/tests.txt" | head -8
