#!/usr/bin/env bash
# Device call 60: the FP8-cache decode kernel alone at the 1k/1k run's 512-sequence steps
# (in a step's graph, call 59: 490 us a layer at 512 x ~1,505 tokens, 76% of the copy floor),
# beside 256 sequences, every FP8 tile, planned splits and 2.
set -uo pipefail
OUT=${OUT:?}
timeout 400 bench/device_env.sh python3 bench/attention_steps.py --part tiles --cache fp8 \
  --splits 2 --steps 512:1500:1510 512:1025:2047 256:1025:2047 > "$OUT/tiles.txt" 2>&1
cat "$OUT/tiles.txt" | cut -c1-200
