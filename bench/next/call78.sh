#!/usr/bin/env bash
# Device call 78 (branch gpu-next21): decode attention's merge over the splits that hold keys
# only (`triton_splits.live_splits`: an empty split stores and counts nothing, a lone live
# split writes the output itself; a graph's NUM_SPLITS is cut for its longest context, so at
# a short one most are empty: 32 at batch 1 under a server's 8k context, 3 under bench
# latency's default). Against main (.stage/base; `bash bench/next/stage.sh` here first, carry
# .whl and .stage).
#   call78.sh ab     GPU tests, then batch 1 at --max-model-len 8192 and the default (~8 min;
#                    the branch's both changes against main: Llama-3-8B has no GEMV `full`
#                    changes, A3B's figure is both, `full` takes the GEMV's apart)
#   call78.sh min    also each split at least 256 keys (so 129-256 keys: one live split) (~4 min)
#   call78.sh full   the one-row GEMV's whole K before the wait where it fits 2048 inputs
#                    (`triton_gemv.PRELOAD_WHOLE`: A3B's router) against it off (~4 min)
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
if [ "${1:-ab}" = ab ]; then
  timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
    tests/gpu/test_triton_cuda.py tests/gpu/test_fp8_kv_cuda.py \
    tests/gpu/test_dependent_launch_cuda.py -k "decode or e4m3 or graph or gemv" \
    > "$OUT/tests.txt" 2>&1
  grep -aE "passed|failed|error" "$OUT/tests.txt" | tail -2
  for m in llama-3-8b qwen3-30b-a3b; do
    timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/$m-8k" bench latency --model $m $A \
      --max-model-len 8192 > "$OUT/ab-$m-8k.txt" 2>&1
  done
  timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/a3b-default" bench latency \
    --model qwen3-30b-a3b $A > "$OUT/ab-a3b-default.txt" 2>&1
elif [ "$1" = full ]; then
  mkdir -p /tmp/half && cp -r engine bench cli gateway operator /tmp/half/
  sed -i 's/^PRELOAD_WHOLE = True/PRELOAD_WHOLE = False/' /tmp/half/engine/layers/triton_gemv.py
  grep -n "^PRELOAD_WHOLE" /tmp/half/engine/layers/triton_gemv.py
  timeout 240 bash bench/ab.sh /tmp/half 2 "$OUT/a3b-whole" bench latency --model qwen3-30b-a3b \
    $A > "$OUT/ab-a3b-whole.txt" 2>&1
else
  mkdir -p /tmp/min256 && cp -r engine bench cli gateway operator /tmp/min256/
  sed -i 's/^_MIN_SPLIT_TOKENS = 128/_MIN_SPLIT_TOKENS = 256/' \
    /tmp/min256/engine/attention/triton_decode.py
  grep -n "^_MIN_SPLIT_TOKENS" /tmp/min256/engine/attention/triton_decode.py
  # (after: 256 keys a split at least; before: this branch as it is)
  mkdir -p /tmp/branch && cp -r engine bench cli gateway operator /tmp/branch/
  cp /tmp/min256/engine/attention/triton_decode.py engine/attention/triton_decode.py
  for m in llama-3-8b qwen3-30b-a3b; do
    timeout 130 bash bench/ab.sh /tmp/branch 1 "$OUT/$m-min256" bench latency --model $m $A \
      --max-model-len 8192 > "$OUT/ab-$m-min256.txt" 2>&1
  done
fi
python3 bench/next/summary.py "$OUT"
