#!/usr/bin/env bash
# Device call 4 (issue 32's table, part 2, ~9 min): batch 64 three times, the 1,000 x 1,024 ->
# 1,024 run three times (preemptions and recomputed tokens in each JSON).
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
for i in 1 2 3; do
  timeout 70 bench/device_env.sh python3 -m kvfleet.cli.main bench latency $L --batch-size 64 \
    --json "$OUT/b64-$i.json" >> "$OUT/log.txt" 2>&1
done
for i in 1 2 3; do
  timeout 150 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L \
    --num-prompts 1000 --input-len 1024 --output-len 1024 --json "$OUT/1k1k-$i.json" >> "$OUT/log.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"; grep -h '"preemptions' "$OUT"/*.json
