#!/usr/bin/env bash
# Device call 5 (issue 32's table, part 3, ~9 min): online 4 req/s 1,024 -> 256 and the shared
# prefix (caching on, then off) three times, through bench/serve_suite.sh (its folders under
# /tmp: engine logs and nine JSONs exceed what $OUT returns; the figures are printed).
set -uo pipefail
OUT=${OUT:?}
for i in 1 2 3; do
  SUITE="online prefix" timeout 180 bench/device_env.sh bash bench/serve_suite.sh "/tmp/serve-$i" \
    >> "$OUT/log.txt" 2>&1
done
for f in /tmp/serve-*/*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1][5:], {k: d[k] for k in ('ttft_ms', 'itl_ms', 'ttft_ms_mean') if k in d})" "$f"
done | tee "$OUT/serve.txt"
