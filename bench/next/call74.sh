#!/usr/bin/env bash
# Device call 74 (branch gpu-next20): the one-row bf16 GEMV at half its inputs a tile on 8 warps
# where its programs all fit at once (`triton_gemv.one_row_plan`, PRELOAD_HALF: Qwen3-30B-A3B's
# o (2048 x 4096) and router, Mixtral's router), the first half of each program's weight loaded
# before it waits for the kernel before; against main (.stage/base; `bash bench/next/stage.sh`
# here first, carry .whl and .stage). The A3B trace after, for bench/next/trace_path.py here.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_dependent_launch_cuda.py tests/gpu/test_families_cuda.py \
  -k "gemv or qwen3-30b-a3b or mixtral" > "$OUT/tests.txt" 2>&1
tail -1 "$OUT/tests.txt"
A="--load-format dummy --batch-size 1"
timeout 240 bash bench/ab.sh .stage/base 2 "$OUT/a3b" bench latency --model qwen3-30b-a3b $A \
  > "$OUT/ab-a3b.txt" 2>&1
timeout 150 bash bench/ab.sh .stage/base 1 "$OUT/mixtral" bench latency --model mixtral-8x7b $A \
  > "$OUT/ab-mixtral.txt" 2>&1
python3 bench/next/summary.py "$OUT"
timeout 120 bench/device_env.sh python3 bench/profile_decode.py --model qwen3-30b-a3b \
  --batch-size 1 --trace "$OUT/trace-a3b.json" > "$OUT/profile-a3b.txt" 2>&1
gzip -f "$OUT/trace-a3b.json"
