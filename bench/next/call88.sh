#!/usr/bin/env bash
# Device call 88 (branch gpu-next23 at its per-head merge): call 85 lost (Llama-3-8B 4.116 ->
# 4.261 ms, A3B 2.637 -> 2.720): the o GEMV merged the splits input by input (4 x 2 exps and
# two lse loads an input: A3B's o program 672 -> 2,360 SASS instructions, 128 MUFU, sm_90) and
# its path went 4.1 -> 7.85 us while attention's went 8.7 -> 4.7. Now the weights are made
# once a head (1,032 instructions, 10 MUFU). Against main (.stage/base; `bash
# bench/next/stage.sh` here first, carry .whl and .stage): the GPU family test, the GEMV and
# dependent-launch tests, batch 1 main -> branch for Llama-3-8B, Qwen3-8B, A3B, A3B's trace.
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py \
  -k "splits_merged or gemv" > "$OUT/tests.txt" 2>&1
grep -aE "passed|failed|error" "$OUT/tests.txt" | tail -3
for m in llama-3-8b qwen3-8b qwen3-30b-a3b; do
  timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/$m" bench latency --model $m $A \
    > "$OUT/ab-$m.txt" 2>&1
done
timeout 150 bench/device_env.sh python3 bench/profile_decode.py --model qwen3-30b-a3b \
  --batch-size 1 --trace "$OUT/trace-a3b.json" > "$OUT/profile-a3b.txt" 2>&1
gzip -f "$OUT/trace-a3b.json"
python3 bench/next/summary.py "$OUT"
