#!/usr/bin/env bash
# Device call 107 (main after gpu-next33 lands, or the branch): INT4's o projection merging
# decode attention's splits as it reads its row (`linear.SPLITS_IN_PACKED_GEMV`, off as built:
# turned on here in the device's copy only). bf16's o did so in session 42 (A3B's attention
# 8.56 -> 4.72 us a layer, o 4.14 -> 4.99); INT4's attention still merges (~8 us a layer on
# its path, session 37). The GPU test (tokens either way), then INT4 (RTN) Llama-3-8B batch 1
# off (.stage/base: stage from this tree first) -> on, two rounds (~6 min). If it wins: the
# flag on, RESULTS, README.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
flag_on engine/layers/linear.py SPLITS_IN_PACKED_GEMV
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py -- "splits_merged_by_the_4_bit"
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
python3 bench/next/summary.py "$OUT"
