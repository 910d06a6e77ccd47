#!/usr/bin/env bash
# Device call 3 (issue 32's table on the H200, part 1, ~9 min): batch 1 and batch 64 three
# times each, the offline 256 x U[128, 1,024] -> 256 run three times beside Hugging Face's
# generate_batch once, all in this call (each run beside its floor measured in its process).
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
run() { timeout "$1" bench/device_env.sh python3 -m kvfleet.cli.main bench "${@:3}" --json "$OUT/$2.json" >> "$OUT/log.txt" 2>&1; }
for i in 1 2 3; do run 70 "b1-$i" latency $L --batch-size 1; done
for i in 1 2 3; do run 80 "b64-$i" latency $L --batch-size 64; done
for i in 1 2 3; do run 80 "offline-$i" throughput $L; done
timeout 150 bench/device_env.sh python3 bench/hf_peer.py --part batch --json "$OUT/hf.json" >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
