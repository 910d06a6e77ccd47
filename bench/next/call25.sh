#!/usr/bin/env bash
# Device call 25 (nvidia-h200-x2, ~9 min): issue 32's "nothing else regressed" for tensor
# parallelism, last measured 2026-11-24 (bench/RESULTS.md): the 2-GPU tests (asynchronous TP
# against TP=1 in float32, the fused peer all-reduce + norm), then the 8B 256-request throughput
# at TP=1 and TP=2 and the 70B TP=2 batch-1 decode (bench/tp_suite.sh).
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_async_tp_cuda.py tests/gpu/test_peer_norm_cuda.py \
  > "$OUT/tp_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tp_tests.txt" | tail -6
timeout 360 bench/device_env.sh bash bench/tp_suite.sh "$OUT/tp" tput latency70 2>&1 | tail -40
