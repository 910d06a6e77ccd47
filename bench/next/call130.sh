#!/usr/bin/env bash
# Device call 130 (session 48): `triton_gemv.FP8_BF16_ROW` on in this copy: its GPU test against
# the dequantized weights in bf16, the FP8 layer and token tests, the norms test's divergence
# (bench/next/norms_fp8_diag.py), then FP8 Llama-3-8B batch-1 traces: main, FP8_BF16_ROW, and
# with FP8_ROW_WIDE (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
G=engine/layers/triton_gemv.py
flag_on $G FP8_BF16_ROW
TEST_LIMIT=150 gpu_tests tests/gpu/test_families_cuda.py -- "fp8_rows_taken"
mv "$OUT/tests.txt" "$OUT/tests-rows.txt"
grep -aE "^E  " "$OUT/tests-rows.txt" | head -6
TEST_LIMIT=200 gpu_tests tests/gpu/test_fp8_cuda.py tests/gpu/test_families_cuda.py -- \
  "layer_matches or decode_graphs or (rope_in_the_qkv and fp8 and llama)"
grep -aE "^E  " "$OUT/tests.txt" | head -6
timeout 120 bench/device_env.sh python3 bench/next/norms_fp8_diag.py > "$OUT/norms.txt" 2>&1
tail -3 "$OUT/norms.txt"
for v in base row wide; do
  if [ $v = base ]; then sed -i "s/^FP8_BF16_ROW = True/FP8_BF16_ROW = False/" $G; fi
  if [ $v = row ]; then sed -i "s/^FP8_BF16_ROW = False/FP8_BF16_ROW = True/" $G; fi
  if [ $v = wide ]; then flag_on $G FP8_ROW_WIDE; fi
  timeout 120 bench/device_env.sh python3 bench/profile_decode.py --model llama-3-8b \
    --batch-size 1 --quantization fp8 --trace "$OUT/trace-fp8-$v.json" > "$OUT/profile-$v.txt" 2>&1
  gzip -f "$OUT/trace-fp8-$v.json"
done
ls -la "$OUT"
