#!/usr/bin/env bash
# Device call 1: the decode kernel's tiles and splits at batch 64's short step (and the long
# ones, for what a change would cost there); batch 64 and Qwen3-30B-A3B batch 1 against main.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 bench/attention_steps.py --part tiles --cache bf16 \
  --splits 1 2 4 > "$OUT/tiles.txt" 2>&1; grep -v "^WARNING" "$OUT/tiles.txt" | cut -c1-160
timeout 100 bash bench/ab.sh .stage/base 1 "$OUT/b64" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 64 > "$OUT/log.txt" 2>&1
timeout 200 bash bench/ab.sh .stage/base 1 "$OUT/a3b" bench latency --model qwen3-30b-a3b \
  --load-format dummy --batch-size 1 >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
