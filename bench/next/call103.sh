#!/usr/bin/env bash
# Device call 103 (branch gpu-next32): one kernel form for both large layers? Call 102's best
# were gate_up (256, 32, 2) as named 4-row chunks and down (256, 32, 1, 8) as 8-row tiles
# (INT4 Llama-3-8B 2.512 -> 2.321 ms); the tile form at 4-row chunks beside them, then batch 1
# with gate_up in the tile form (~4 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
timeout 150 bench/device_env.sh python3 bench/int4_rows.py --shapes gate_up down --tiles \
  256,32,2 256,32,2,4 256,32,1,4 256,32,1,8 256,16,1,4 128,32,1,4 > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt"
export KVFLEET_INT4_ROWS="28672x4096=256,32,2,4;4096x14336=256,32,1,8"
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 1 llama-3-8b
python3 bench/next/summary.py "$OUT"
