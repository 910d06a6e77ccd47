#!/usr/bin/env bash
# Device call 29 (~2 min): call 28 found a lone 1,024-token prompt's attention at 52.5 us a layer
# plus 40.8 of merging its two key splits (3 ms of the 26.6-ms step; the matmuls 19.2 ms at 98%
# of the measured peak). The prompt kernel at the plan's splits and at 1, 2, 4, on lone prompts,
# two prompts, a prefix hit and a chunk after cached tokens; then the mixed steps (decodes beside
# a 1,024 prompt: the online row's steps).
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 bench/attention_steps.py --part prompt-splits \
  --splits 1 2 4 > "$OUT/splits.txt" 2>&1
grep -v "^\s*$" "$OUT/splits.txt" | tail -52
timeout 150 bench/device_env.sh python3 bench/attention_steps.py --part mixed > "$OUT/mixed.txt" 2>&1
tail -12 "$OUT/mixed.txt"
