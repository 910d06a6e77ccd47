#!/usr/bin/env bash
# Device call 126 (session 47, and next session's first): `triton_gemv.TUNED_ONE_ROW`'s batch-1
# token checks (Phi-3-mini passed in session 47 at ccb1b36; Gemma-3-12B's found its LM head
# outside the one-row GEMV, the entry dropped, the token check to run) (~1 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=130 gpu_tests tests/gpu/test_families_cuda.py -- "tuned_one_row"
grep -aE "^E " "$OUT/tests.txt" | head -20
