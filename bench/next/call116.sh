#!/usr/bin/env bash
# Device call 116 (main): issue 31's offline fraction, Qwen3-8B against Llama-3-8B in one call
# (`bench throughput`, defaults: 256 requests, dummy bf16; last measured side by side in
# session 16 on the H100: 47.9% against 51.1% of floor), twice each, alternated (~6 min).
set -uo pipefail
OUT=${OUT:?}
for round in 1 2; do
  for m in llama-3-8b qwen3-8b; do
    timeout 140 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput --model "$m" \
      --load-format dummy --json "$OUT/offline-$m-$round.json" > "$OUT/log-$m-$round.txt" 2>&1
  done
done
for f in "$OUT"/offline-*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], \
{k: d.get(k) for k in ('output_tok_per_s', 'total_tok_per_s', 'pct_of_floor', 'preemptions')})" "$f"
done
