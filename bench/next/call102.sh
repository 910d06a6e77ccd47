#!/usr/bin/env bash
# Device call 102 (branch gpu-next32): call 101 (INT4 Llama-3-8B 2.513 -> 2.427 ms with gate_up
# and down at (256, 32, 2)) with chunks as [CHUNK, BLOCK_N] tiles, 8 or 16 word rows in flight
# a program beside the next: the sweep, the best a layer into the batch-1 A/B, the 4-bit GPU
# tests with the tile kernel at every layer (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
timeout 200 bench/device_env.sh python3 bench/int4_rows.py > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt" | head -80
KVFLEET_INT4_ROWS=$(python3 bench/next/pick_rows.py "$OUT/int4_rows.txt")
export KVFLEET_INT4_ROWS
echo "KVFLEET_INT4_ROWS=$KVFLEET_INT4_ROWS" | tee "$OUT/picked.txt"
[ -n "$KVFLEET_INT4_ROWS" ] && AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
KVFLEET_INT4_ROWS="*=256,32,1,8" TEST_LIMIT=150 gpu_tests tests/gpu/test_int4_cuda.py \
  tests/gpu/test_dependent_launch_cuda.py -- "w4a16 or chain"
python3 bench/next/summary.py "$OUT"
