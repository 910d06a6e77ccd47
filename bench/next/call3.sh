#!/usr/bin/env bash
# Device call 3 (issue 32's table on the H200, part 1, ~8 min): the offline 256 x U[128, 1,024]
# -> 256 run three times beside Hugging Face's generate_batch once, and batch 1 three times
# (each run beside its floor measured in its own process).
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
run() { timeout "$1" bench/device_env.sh python3 -m kvfleet.cli.main bench "${@:3}" --json "$OUT/$2.json" >> "$OUT/log.txt" 2>&1; }
for i in 1 2 3; do run 80 "offline-$i" throughput $L; done
timeout 200 bench/device_env.sh python3 bench/hf_peer.py --part batch --json "$OUT/hf.json" >> "$OUT/log.txt" 2>&1
for i in 1 2 3; do run 70 "b1-$i" latency $L --batch-size 1; done
python3 bench/next/summary.py "$OUT"; grep -h "tok_per_s\|output_tok" "$OUT/hf.json" | head -3
