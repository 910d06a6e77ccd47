#!/usr/bin/env bash
# Device call 85 (branch gpu-next23): decode attention at batch 1 leaves up to 4 splits holding
# keys unmerged (`SplitRows`: each split's output in bf16 and its log-sum-exp), for the o
# projection's one-row GEMV to merge as it reads its row (`linear.SPLITS_IN_GEMV`; call 82: the
# partials, counter and merge took 4.5 us of the kernel's 8.65 a layer at Qwen3-30B-A3B).
# Against main (.stage/base; `bash bench/next/stage.sh` here first, carry .whl and .stage).
#   call85.sh        GPU tests (the new family test, decode, GEMV), then batch 1 main -> branch
#                    for Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B, and A3B's trace (~7 min)
#   call85.sh 8k     batch 1 under an 8k context, SPLITS_IN_GEMV 4 against 0 (~3 min)
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
if [ "${1:-ab}" = ab ]; then
  . bench/next/batch1.sh
  TEST_LIMIT=300 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py \
    tests/gpu/test_dependent_launch_cuda.py tests/gpu/test_engine_cuda.py -- \
    "splits_merged or decode or gemv or graph or compiles_mid_serving"
  batch1_ab 1 llama-3-8b qwen3-8b qwen3-30b-a3b
  batch1_trace qwen3-30b-a3b
else
  mkdir -p /tmp/off && cp -r engine bench cli gateway operator /tmp/off/
  sed -i 's/^SPLITS_IN_GEMV = 4/SPLITS_IN_GEMV = 0/' /tmp/off/engine/layers/linear.py
  grep -n "^SPLITS_IN_GEMV" /tmp/off/engine/layers/linear.py
  for m in llama-3-8b qwen3-30b-a3b; do
    timeout 130 bash bench/ab.sh /tmp/off 1 "$OUT/$m-8k" bench latency --model $m $A \
      --max-model-len 8192 > "$OUT/ab-$m-8k.txt" 2>&1
  done
fi
python3 bench/next/summary.py "$OUT"
