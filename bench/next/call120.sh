#!/usr/bin/env bash
# Device call 120 (session 46): where Phi-3-mini's batch 1 goes (call 113: 3.47 ms, ~51% of its
# floor, every other dense family 80-89%) and Gemma-3-12B's (6.94 ms, ~80%): batch-1 traces
# at main, then `python3 bench/next/trace_path.py` here.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
batch1_trace phi-3-mini
batch1_trace gemma-3-12b
head -8 "$OUT"/profile-*.txt
