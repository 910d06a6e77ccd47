#!/usr/bin/env bash
# Device call 17 (gpu-next10, ~7 min): batch 1 against main with the qkv GEMV's RoPE + cache
# write: Llama-3-8B bf16, FP8 and 4-bit (rtn), Qwen3-8B, Qwen3-30B-A3B; two rounds
# each, trees alternating.
set -uo pipefail
OUT=${OUT:?}
L="--load-format dummy --batch-size 1"
run() {  # name, then the model's arguments
  local name=$1; shift
  timeout 100 bash bench/ab.sh .stage/base 2 "$OUT/$name" bench latency "$@" $L \
    >> "$OUT/log.txt" 2>&1
}
run bf16 --model llama-3-8b
run fp8 --model llama-3-8b --quantization fp8
run int4 --model llama-3-8b --quantization rtn
run qwen3 --model qwen3-8b
run a3b --model qwen3-30b-a3b
python3 bench/next/summary.py "$OUT"
