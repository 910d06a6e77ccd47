#!/usr/bin/env bash
# Device call 16 (gpu-next10, ~6 min): one token's RoPE and cache write made by the qkv GEMV.
# GPU tests (batch-1 tokens and logprobs with and without it: Llama, Qwen2, Phi-3, Gemma 2
# shapes, bf16 and FP8 caches), then Llama-3-8B bf16 batch 1 and Qwen2.5-7B's (a qkv bias)
# against main, two rounds, trees alternating.
set -uo pipefail
OUT=${OUT:?}
timeout 200 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_families_cuda.py -k "rope_in_the_qkv" > "$OUT/tests.txt" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/tests.txt" | tail -8
timeout 150 bash bench/ab.sh .stage/base 2 "$OUT/b1" bench latency --model llama-3-8b \
  --load-format dummy --batch-size 1 > "$OUT/log.txt" 2>&1
timeout 150 bash bench/ab.sh .stage/base 2 "$OUT/q7" bench latency --model qwen2.5-7b \
  --load-format dummy --batch-size 1 >> "$OUT/log.txt" 2>&1
python3 bench/next/summary.py "$OUT"
