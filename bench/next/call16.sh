#!/usr/bin/env bash
# Device call 16 (gpu-next10, ~7 min): one token's RoPE and cache write (with Qwen3's q/k norms)
# made by the qkv GEMV. GPU tests (batch-1 tokens and logprobs with and without it: Llama,
# Qwen2, Phi-3, Gemma 2, Qwen3, Gemma 3 shapes, bf16 and FP8 caches), then batch 1 against main
# at Llama-3-8B, Qwen3-8B and Qwen3-30B-A3B, two rounds each, trees alternating.
set -uo pipefail
OUT=${OUT:?}
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "rope_in_the_qkv" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -8
for model in llama-3-8b qwen3-8b qwen3-30b-a3b; do
  timeout 110 bash bench/ab.sh .stage/base 2 "$OUT/$model" bench latency --model $model \
    --load-format dummy --batch-size 1 >> "$OUT/log.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
