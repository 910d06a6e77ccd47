#!/usr/bin/env bash
# Device call 127 (session 48): call 126's token tests (Gemma-3-12B's LM head keyed at 262,208),
# then the e4m3 one-row GEMVs alone at wider tiles: the CUDA-core kernel at the bytes a tile of
# bf16's 8 x 1,024 (8 x 2,048 e4m3) and the tensor-core one below 64 rows a program.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=150 gpu_tests tests/gpu/test_families_cuda.py -- "tuned_one_row"
grep -aE "^E " "$OUT/tests.txt" | head -20
timeout 300 bench/device_env.sh python3 bench/fp8_gemv.py --tiles 8,1024,4,3 8,2048,4,3 \
  16,1024,4,3 4,2048,4,3 8,2048,8,3 16,2048,8,3 --mma 64,512,4 16,512,4 32,512,4 16,1024,4 \
  > "$OUT/fp8_gemv.txt" 2>&1
tail -c 6000 "$OUT/fp8_gemv.txt"
