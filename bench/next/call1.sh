#!/usr/bin/env bash
# Device call 1 (about 9 minutes): GPU tests of the changed kernels and paths; the batch-1 layer
# chain; batch-1 bf16 decode against main in the same call.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 360 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -rA \
  -p no:cacheprovider tests/gpu/test_dependent_launch_cuda.py tests/gpu/test_fp8_cuda.py \
  tests/gpu/test_triton_cuda.py tests/gpu/test_fp8_kv_cuda.py -k "not smollm2" \
  > "$OUT/tests.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests.txt"
grep -E "passed|failed|FAILED|rc=" "$OUT/tests.txt" | tail -15
timeout 80 bench/device_env.sh python3 bench/gemv_chain.py > "$OUT/chain.txt" 2>&1; cat "$OUT/chain.txt"
timeout 110 bash bench/ab.sh .stage/base 1 "$OUT/b1-bf16" bench latency $L --batch-size 1 2>&1 | grep -v "^WARNING" | tail -4
