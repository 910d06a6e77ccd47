#!/usr/bin/env bash
# Device call 57: after the mixed steps' decodes took their count's first PRELOAD flag: the
# no-compile-while-serving GPU test, swap-out/in with decode graphs, the decode kernel tests.
set -uo pipefail
OUT=${OUT:?}
timeout 400 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_engine_cuda.py tests/gpu/test_triton_cuda.py \
  -k "no_kernel_compiles or swapped or decode" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -8
