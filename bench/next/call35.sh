#!/usr/bin/env bash
# Device call 35 (land34 + CompileWatch, ~6 min): are the online and prefix rows' p99 spikes
# (131-341 ms in calls 32-34) Triton compiles of variants the warm-up missed? The GPU test of
# no compile mid-serving (now through CompileWatch), then the rows with the engine logging each
# compile while serving (`Triton is compiling ... while serving`) and counting them in
# kvfleet:kernel_compiles_while_serving_total.
# (call36.sh runs this with other GPU tests: TESTS, and -k TESTS_K)
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider ${TESTS:-tests/gpu/test_engine_cuda.py} -k "${TESTS_K:-no_kernel_compiles}" \
  2>&1 | grep -E "passed|failed|Error|assert" | tail -6
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
  grep -h "while serving" "$OUT/r$round"/engine-*.log | cut -c1-400 | sort | uniq -c
done
