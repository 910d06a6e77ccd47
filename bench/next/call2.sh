#!/usr/bin/env bash
# Device call 2 (about 9 minutes): 1k/1k FP8 + FP8 KV against main, then at 512 sequences
# (session 25: +4.7% over 256 before the faster attention; 1,024 were slower in session 26);
# batch-1 FP8 against main.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
K="--num-prompts 1000 --input-len 1024 --output-len 1024 --quantization fp8 --kv-cache-dtype fp8"
timeout 260 bash bench/ab.sh .stage/base 1 "$OUT/1k1k-fp8" bench throughput $L $K 2>&1 | grep -v "^WARNING" | tail -6
timeout 130 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L $K --max-num-seqs 512 \
  --json "$OUT/1k1k-fp8-512.json" 2>&1 | grep -v "^WARNING" | tail -4
timeout 110 bash bench/ab.sh .stage/base 1 "$OUT/b1-fp8" bench latency $L --batch-size 1 --quantization fp8 2>&1 | grep -v "^WARNING" | tail -4
