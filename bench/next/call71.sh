#!/usr/bin/env bash
# Device call (session 39): the FP8 1k/1k as it ships (the decode kernel's e4m3 products on,
# the prompt kernel's off), bf16's 1k/1k in the same call (the 1.8x row), then FP8 with the
# decode kernel upcasting (the A/B), as far as the time allows.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 1024 --output-len 1024"
run() {  # name, limit, arguments
  local name=$1 limit=$2; shift 2
  grep -h "^E4M3_PRODUCTS" engine/attention/triton_decode.py engine/attention/triton_prompt.py | tr '\n' ' '
  timeout "$limit" bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name: $(grep -hE '"output_tok_per_s"|"mean_ms"|"preemptions"' "$OUT/$name.txt" | tr -d ' \n')"
}
run fp8-shipped 130 --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512
run bf16 150 
sed -i 's/^E4M3_PRODUCTS = True/E4M3_PRODUCTS = False/' engine/attention/triton_decode.py
run fp8-upcasting 130 --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512
