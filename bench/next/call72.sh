#!/usr/bin/env bash
# Device call 72 (branch gpu-next19): the one-token MoE GEMVs' prologue and loop order, against
# main (.stage/base; `bash bench/next/stage.sh` here first, carry .whl and .stage).
#  - `triton_moe.top_k_rows` for one token: the ranks counted against 32 logits at a time, the
#    choices in their slots by one sum (sm_90 SASS of Qwen3-30B-A3B's gate_up: 60 barriers ->
#    22) where the choices one after another took 16 cross-warp reductions;
#  - gate_up: the expert, then its first tiles' loads, then the row's norm while they come in
#    (main: the norm, then the top k, then the first weights); in the loop the weights' loads
#    before the row's (main: the row's, a layout exchange through shared memory, then the
#    weights': both latencies in turn, every step); down's loops the same.
# `call72.sh layer`: GPU tests and bench/moe_layer.py in both trees; `call72.sh e2e`: batch 1.
set -uo pipefail
OUT=${OUT:?}
if [ "${1:-layer}" = layer ]; then
  timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
    tests/gpu/test_families_cuda.py tests/gpu/test_dependent_launch_cuda.py \
    -k "one_token or qwen3-30b-a3b or mixtral or moe" > "$OUT/tests.txt" 2>&1
  tail -2 "$OUT/tests.txt"
  timeout 120 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/layer-after.txt" 2>&1
  mkdir -p /tmp/src-before/kvfleet  # (main's tree; the wheels installed by the run above)
  for c in cli engine gateway operator bench; do
    [ -d ".stage/base/$c" ] && ln -sfn "$PWD/.stage/base/$c" "/tmp/src-before/kvfleet/$c"
  done
  PYTHONPATH=/tmp/src-before:/tmp/site KVFLEET_HOME=$HOME/kvhome timeout 120 \
    python3 .stage/base/bench/moe_layer.py > "$OUT/layer-before.txt" 2>&1
  # gate_up's tiles a step ahead (triton_moe_gemv.PREFETCH_NEXT_TILES at 9444d5d, where it ran;
  # lost: 35.8 against 34.1 us a layer, and removed; the sed matches nothing since)
  sed -i 's/^PREFETCH_NEXT_TILES = False/PREFETCH_NEXT_TILES = True/' engine/layers/triton_moe_gemv.py
  timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
    tests/gpu/test_families_cuda.py -k one_token > "$OUT/tests-prefetch.txt" 2>&1
  tail -1 "$OUT/tests-prefetch.txt"
  timeout 120 bench/device_env.sh python3 bench/moe_layer.py > "$OUT/layer-prefetch.txt" 2>&1
  sed -i 's/^PREFETCH_NEXT_TILES = True/PREFETCH_NEXT_TILES = False/' engine/layers/triton_moe_gemv.py
  for t in after before prefetch; do
    echo "== $t"; grep -iE "token|gemv|floor" "$OUT/layer-$t.txt" | head -12
  done
  exit 0
fi
A="--load-format dummy --batch-size 1"
timeout 240 bash bench/ab.sh .stage/base 2 "$OUT/a3b" bench latency --model qwen3-30b-a3b $A \
  > "$OUT/ab-a3b.txt" 2>&1
timeout 300 bash bench/ab.sh .stage/base 1 "$OUT/mixtral" bench latency --model mixtral-8x7b $A \
  > "$OUT/ab-mixtral.txt" 2>&1
python3 bench/next/summary.py "$OUT"
