#!/usr/bin/env bash
# Device call 65: issue 30's 1k/1k row in one call, FP8 + FP8 KV at 512 sequences with prompt
# steps of 16,384 tokens, and at 768 sequences; bf16 at its default 256 sequences, and with
# 16,384-token prompt steps.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 1024 --output-len 1024"
Q="--quantization fp8 --kv-cache-dtype fp8"
run() {
  local name=$1; shift
  timeout 240 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name: $(grep -E '"output_tok_per_s"|"mean_ms"|"count"|"preemptions"' "$OUT/$name.txt" | tr -d ' \n')"
}
run fp8-512-16k $Q --max-num-seqs 512 --max-num-batched-tokens 16384
run fp8-768 $Q --max-num-seqs 768
run bf16-256 
run bf16-256-16k --max-num-batched-tokens 16384
