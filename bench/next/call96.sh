#!/usr/bin/env bash
# Device call 96 (any branch; main's tree): where Qwen3-8B's batch 1 (~83% of its floor) loses
# to Llama-3-8B's (~88%) layer by layer: both steps' traces (`bench/profile_decode.py --trace`,
# then `python3 bench/next/trace_path.py` here on each), for issue 31's "the same fractions as
# Llama-3-8B" (~2 min). The q/k norms' count and reload in the qkv GEMV were put at ~2 us a
# layer (call 77); the rest of the ~6 us a layer is not yet placed.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
batch1_trace qwen3-8b
batch1_trace llama-3-8b
tail -n 3 "$OUT"/profile-*.txt
