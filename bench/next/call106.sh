#!/usr/bin/env bash
# Device call 106 (branch gpu-next33 or main after it lands): the whole-column 4-bit GEMV with
# the words two chunks ahead (AHEAD 2: named form 94 registers at 2 warps; 8-row tiles spill at
# one warp, fit at two), beside the landed tilings, at all four Llama-3-8B layers (~2 min).
# Where a variant beats the plan's by 3%, change `triton_packed_rows` WIDE_TILES / LONG_TILES
# and A/B batch 1 (`AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b`).
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 bench/int4_rows.py --tiles 256,32,2 256,32,1,8 \
  256,32,2,0,2 256,64,2,0,2 256,32,1,0,2 256,32,2,8,2 256,64,2,8,2 256,16,2,0,2 128,32,1,0,2 \
  > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt"
