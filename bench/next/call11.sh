#!/usr/bin/env bash
# Device call 11 (~8 min; issue 31): Qwen3-30B-A3B's offline 256 x U[128, 1,024] -> 256 beside
# Hugging Face's generate_batch in the same call (target 15x; 10.7x on the H100 in session 16,
# whose pool could not hold the 256 requests: the H200's can).
set -uo pipefail
OUT=${OUT:?}
timeout 120 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput \
  --model qwen3-30b-a3b --load-format dummy --json "$OUT/a3b-offline.json" > "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"; grep -h '"preemptions"\|"kv_blocks"' "$OUT/a3b-offline.json"
timeout 450 bench/device_env.sh python3 bench/hf_peer.py --model qwen3-30b-a3b --part batch \
  --json "$OUT/hf-a3b.json" >> "$OUT/log.txt" 2>&1
grep -h "tok_per_s" "$OUT/hf-a3b.json"; tail -3 "$OUT/log.txt" | cut -c1-200
