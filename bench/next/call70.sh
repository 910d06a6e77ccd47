#!/usr/bin/env bash
# Device call (session 39): the prompt kernel's e4m3 path after its fix (the weights' sum taken
# before rounding; bench/next/e4m3_prompt_debug.py), both e4m3 paths' GPU tests, SmolLM2's
# FP8-KV quality with both on, then the FP8 1k/1k with both on and with both off, one call.
# SmolLM2's GGUF must be in $HOME/kvhome (bench/next/stage_smollm2.sh).
# `call70.sh kernels` (the probe and the tests, no model) and `call70.sh serving` (the rest) as
# the two calls that stage the GGUF.
set -uo pipefail
OUT=${OUT:?}
if [ "${1:-}" = kernels ]; then
timeout 60 bench/device_env.sh python3 bench/next/e4m3_prompt_debug.py 2>&1 | grep -v "e4m3 False" \
  | grep -E "mode (0|3)" > "$OUT/probe.txt"; cat "$OUT/probe.txt"
timeout 120 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -s \
  tests/gpu/test_fp8_kv_cuda.py -k "e4m3" > "$OUT/tests.txt" 2>&1
grep -E "relative error|passed|failed|Error" "$OUT/tests.txt" | tail -8
exit 0
fi
cp engine/attention/triton_decode.py engine/attention/triton_prompt.py "$OUT/"
sed -i 's/^E4M3_PRODUCTS = False/E4M3_PRODUCTS = True/' engine/attention/triton_decode.py engine/attention/triton_prompt.py
timeout 150 bench/device_env.sh python3 -m kvfleet.bench.quality --model smollm2 \
  --kv-cache-dtype fp8 --decode-perplexity --json "$OUT/quality-kv-both.json" > "$OUT/quality-both.txt" 2>&1
grep -E "equal|perplexity" "$OUT/quality-both.txt"
L="--model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 1024 --output-len 1024"
for mode in on off; do
  [ $mode = off ] && cp "$OUT/triton_decode.py" "$OUT/triton_prompt.py" engine/attention/
  grep -h "^E4M3_PRODUCTS" engine/attention/triton_decode.py engine/attention/triton_prompt.py
  timeout 160 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput $L --quantization fp8 \
    --kv-cache-dtype fp8 --max-num-seqs 512 --json "$OUT/fp8-$mode.json" > "$OUT/fp8-$mode.txt" 2>&1
  grep -E '"output_tok_per_s"|"mean_ms"|"preempt' "$OUT/fp8-$mode.txt"
done
rm -f "$OUT/triton_decode.py" "$OUT/triton_prompt.py"
