#!/usr/bin/env bash
# Device call 111 (main after session 45's landings): every 4-warp one-row GEMV with its next
# weight tile loaded while one is used (`triton_gemv.GEMV_AHEAD`, as the split-merging o does
# since call 109), alone (`bench/gemv.py`, beside the down GEMV at other tiles: Qwen3-8B's down
# took as long as Llama-3-8B's, 14% larger, in call 96's traces) and at batch 1 (Llama-3-8B,
# Qwen3-8B, two rounds), then Llama-3-8B's batch-1 trace at main (o's path now) (~5 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
timeout 150 bench/device_env.sh python3 bench/gemv.py --methods triton ahead --shapes \
  8b-tp1-qkv 8b-tp1-o 8b-tp1-gate_up 8b-tp1-down qwen3-8b-gate_up qwen3-8b-down \
  --tiles 8,1024,4,3 16,512,4,3 8,256,4,3 8,512,8,3 4,1024,4,3 > "$OUT/gemv.txt" 2>&1
cat "$OUT/gemv.txt"
variant ahead engine/layers/triton_gemv.py GEMV_AHEAD
batch1_variants 2 llama-3-8b .stage/base /tmp/var/ahead
batch1_variants 2 qwen3-8b .stage/base /tmp/var/ahead
batch1_trace llama-3-8b
python3 bench/next/summary.py "$OUT"
