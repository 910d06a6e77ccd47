#!/usr/bin/env bash
# Device call 101 (branch gpu-next32): the whole-columns 4-bit GEMV with its next group's
# scale and zero loaded a chunk ahead (call 100: the loop stalled on them once a group),
# swept at Llama-3-8B's shapes; the best tiling a layer where it beats the shipped kernel by 3%
# (bench/next/pick_rows.py) then runs INT4 (RTN) Llama-3-8B batch 1 main -> branch, two
# rounds; the 4-bit GPU tests with the kernel at every layer (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
timeout 200 bench/device_env.sh python3 bench/int4_rows.py > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt" | head -80
KVFLEET_INT4_ROWS=$(python3 bench/next/pick_rows.py "$OUT/int4_rows.txt")
export KVFLEET_INT4_ROWS
echo "KVFLEET_INT4_ROWS=$KVFLEET_INT4_ROWS" | tee "$OUT/picked.txt"
[ -n "$KVFLEET_INT4_ROWS" ] && AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
KVFLEET_INT4_ROWS="*=256,32,1" TEST_LIMIT=150 gpu_tests tests/gpu/test_int4_cuda.py \
  tests/gpu/test_dependent_launch_cuda.py -- "w4a16 or chain"
python3 bench/next/summary.py "$OUT"
