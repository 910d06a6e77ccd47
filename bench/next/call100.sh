#!/usr/bin/env bash
# Device call 100 (branch gpu-next32): the whole-columns 4-bit GEMV in a loop of 4-row chunks,
# the next chunk loaded while one is used (call 99's unrolled form: gate_up 27.9 -> 22.5 us,
# qkv and o slower, down past the call's time), swept at Llama-3-8B's shapes (~3 min).
set -uo pipefail
OUT=${OUT:?}
timeout 300 bench/device_env.sh python3 bench/int4_rows.py > "$OUT/int4_rows.txt" 2>&1
tr '|' '\n' < "$OUT/int4_rows.txt" | head -80
