#!/usr/bin/env bash
# Device call 126 (session 47, and next session's first): `triton_gemv.TUNED_ONE_ROW`'s batch-1
# token checks (Phi-3-mini passed in session 47 at ccb1b36; Gemma-3-12B's failed its plans check:
# its LM head keyed at 262,144 rows, its vocabulary 262,208; fixed, the token check to run).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=130 gpu_tests tests/gpu/test_families_cuda.py -- "tuned_one_row"
grep -aE "^E " "$OUT/tests.txt" | head -20
