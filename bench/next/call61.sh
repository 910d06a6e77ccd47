#!/usr/bin/env bash
# Device call 61: the FP8-cache decode kernel over 32 layers' caches in turn against one
# layer's again and again (call 60: 376 us alone at 512 x ~1,505, 100% of floor; ~490 in the
# engine's step), by block placement and pool size.
set -uo pipefail
OUT=${OUT:?}
timeout 400 bench/device_env.sh python3 bench/decode_layers.py --steps 512:1500:1510 \
  256:1025:2047 --pool-blocks 0 100000 > "$OUT/layers.txt" 2>&1
cat "$OUT/layers.txt" | cut -c1-220
