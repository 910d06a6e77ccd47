#!/usr/bin/env bash
# Device call 129 (session 48): `triton_gemv.FP8_BF16_ROW` (won in call 128: FP8 Llama-3-8B
# batch 1 2.861 -> 2.675 ms) and with FP8_ROW_WIDE (twice the inputs a tile, products summed in
# pairs: the bf16 plan's bytes and registers): alone, batch 1 main against each (FP8 Llama-3-8B
# two rounds, Qwen3-8B one), its GPU test, and the FP8 GPU tests with it on (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
G=engine/layers/triton_gemv.py
timeout 100 bench/device_env.sh python3 bench/fp8_gemv.py --bf16-row --wide --mma --tiles \
  8,2048,4,3 16,1024,4,3 8,4096,8,1 16,2048,4,3 > "$OUT/fp8_wide.txt" 2>&1
tail -4 "$OUT/fp8_wide.txt" | cut -c1-400
variant row $G FP8_BF16_ROW
variant roww $G FP8_BF16_ROW $G FP8_ROW_WIDE
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 2 llama-3-8b .stage/base /tmp/var/row \
  /tmp/var/roww
AB_ARGS="--quantization fp8" AB_TAG=-fp8 batch1_variants 1 qwen3-8b .stage/base /tmp/var/row \
  /tmp/var/roww
python3 bench/next/summary.py "$OUT"
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py -- "fp8_rows_taken"
mv "$OUT/tests.txt" "$OUT/tests-rows.txt"
grep -aE "^E " "$OUT/tests-rows.txt" | head -10
flag_on $G FP8_BF16_ROW
TEST_LIMIT=150 gpu_tests tests/gpu/test_fp8_cuda.py -- \
  "layer_matches or norms_in_the_gemvs or decode_graphs"
grep -aE "^E " "$OUT/tests.txt" | head -10
