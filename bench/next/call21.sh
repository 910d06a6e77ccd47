#!/usr/bin/env bash
# Device call 21 (~9 min): issue 32's "nothing else regressed" on one GPU: multi-LoRA at batch
# 64 (bench/RESULTS.md "2026-11-22 (night)": base, 8 adapters across the 64, LoRA on with base
# requests) and speculative decoding on the 8B dummy (n-gram k=4 at batch 1 and 64, the
# llama-3.2-1b draft k=4 at batch 1: what failing speculation costs), each its own process.
# (TP=2 needs the nvidia-h200-x2 kind: bench/tp_suite.sh.)
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy --batch-size 64 --input-len 512 --output-len 128"
for lora in "" "--num-loras 8 --lora-rank 16 --lora-share 1" \
  "--num-loras 8 --lora-rank 16 --lora-share 0"; do
  timeout 100 bench/device_env.sh python3 -m kvfleet.cli.main bench latency $L $lora \
    > "$OUT/lora.txt" 2>&1
  echo "lora [$lora]:"; grep -E '"(decode_ms_per_token|pct_of_floor|output_tok_per_s|ttft_ms)"' "$OUT/lora.txt"
done
S="--model llama-3-8b --load-format dummy --dtype bfloat16"
ngram4='{"method": "ngram", "num_speculative_tokens": 4}'
draft4='{"method": "draft", "model": "llama-3.2-1b", "num_speculative_tokens": 4}'
for run in "1|$ngram4" "64|$ngram4" "1|$draft4"; do
  batch=${run%%|*}; config=${run#*|}
  timeout 120 bench/device_env.sh python3 -m kvfleet.cli.main bench speculative $S \
    --batch-size "$batch" --speculative-config "$config" --json "$OUT/spec.json" \
    > "$OUT/spec.txt" 2>&1
  echo "spec b$batch $config:"; tail -4 "$OUT/spec.txt"
done
