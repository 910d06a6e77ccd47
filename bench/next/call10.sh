#!/usr/bin/env bash
# Device call 10 (~3 min): batch-1 decode attention at Qwen3-30B-A3B's heads (4 KV heads) and
# Llama-3-8B's (8), short and mid contexts: the shipped least tokens a split (128) against 32
# and 64 (more, shorter splits for one sequence's few programs), each tile.
set -uo pipefail
OUT=${OUT:?}
for heads in 4 8; do
  timeout 250 bench/device_env.sh python3 bench/attention_steps.py --part tiles --cache bf16 \
    --kv-heads $heads --steps 1:129:256 1:900:1100 --min-split 32 64 > "$OUT/kv$heads.txt" 2>&1
  grep -v "^WARNING" "$OUT/kv$heads.txt" | grep -E "tile|GB/s|rror" | cut -c1-150
done
