#!/usr/bin/env bash
# Device call 75 (branch gpu-next20): the GPU tests over call 74's tiles (its 200 s ran out),
# then 16-row one-row GEMV programs at 512 inputs a tile where four an SM hold them all
# (`triton_gemv.WIDE_QKV`: Qwen3-30B-A3B's and Llama-3-8B's qkv, a quarter of K before the
# wait where 256 took an eighth) against the same tree with it off.
set -uo pipefail
OUT=${OUT:?}
timeout 280 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q -x \
  tests/gpu/test_dependent_launch_cuda.py tests/gpu/test_families_cuda.py \
  -k "gemv or qwen3 or mixtral or llama" > "$OUT/tests.txt" 2>&1
grep -aE "passed|failed|error" "$OUT/tests.txt" | tail -3
mkdir -p /tmp/narrow && cp -r engine bench cli gateway operator /tmp/narrow/
sed -i 's/^WIDE_QKV = True/WIDE_QKV = False/' /tmp/narrow/engine/layers/triton_gemv.py
A="--load-format dummy --batch-size 1"
timeout 120 bash bench/ab.sh /tmp/narrow 1 "$OUT/a3b" bench latency --model qwen3-30b-a3b $A \
  > "$OUT/ab-a3b.txt" 2>&1
timeout 120 bash bench/ab.sh /tmp/narrow 1 "$OUT/llama" bench latency --model llama-3-8b $A \
  > "$OUT/ab-llama.txt" 2>&1
python3 bench/next/summary.py "$OUT"
