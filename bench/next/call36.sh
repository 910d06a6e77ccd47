#!/usr/bin/env bash
# Device call 36 (land34: no compile while serving, ~6 min): call 35's CompileWatch saw the
# prompt split's merge kernel compiled at each new split count (3, 5, 6, 9, 17) and the LM
# head's one-row GEMV and the vocabulary race at each engine's first request. Now the merge
# takes any count in one variant and both tail kernels compile at startup. GPU tests (the
# no-compile test from the first request on; prompt attention against torch), then the online
# and prefix rows with the engine's compile log.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_engine_cuda.py tests/gpu/test_triton_cuda.py \
  -k "no_kernel_compiles or kernels_match_torch" 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
for round in 1 2; do
  suite="online prefix"; [ $round = 2 ] && suite=online
  SUITE=$suite timeout 200 bench/device_env.sh bash bench/serve_suite.sh "$OUT/r$round" \
    > /dev/null 2>&1
  for f in "$OUT/r$round"/*.json; do
    python3 - "$f" "r$round $(basename "$f" .json)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: r[k] for k in ("ttft_ms", "e2e_ms", "engine") if k in r})
PY
  done
  grep -h "while serving" "$OUT/r$round"/engine-*.log | cut -c1-300 | sort | uniq -c
done
