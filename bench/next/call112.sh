#!/usr/bin/env bash
# Device call 112 (main after call 111): bf16 layers of up to 4,096 outputs that do not preload
# (Llama-3-8B's and Qwen3-8B's o and down) with tiles of 1,024 inputs (`triton_gemv.WIDE_BF16`:
# 8 rows a program; with `WIDE_BF16_FOUR`: 4), which call 111's bench/gemv.py put at o 12.2 ->
# 8.7 us and down 40.1 -> 27.4 alone; the o GPU tests with both on, then batch 1 main / wide8 /
# wide4, Llama-3-8B two rounds, Qwen3-8B two (~5.5 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/triton_gemv.py
variant wide8 $F WIDE_BF16
variant wide4 $F WIDE_BF16 $F WIDE_BF16_FOUR
flag_on $F WIDE_BF16 && flag_on $F WIDE_BF16_FOUR  # (this copy: the GPU tests with 4 rows)
TEST_LIMIT=100 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "splits_left_to_the_o or (splits_merged_by_the_o_gemv and llama)"
batch1_variants 2 llama-3-8b .stage/base /tmp/var/wide8 /tmp/var/wide4
batch1_variants 2 qwen3-8b .stage/base /tmp/var/wide8 /tmp/var/wide4
python3 bench/next/summary.py "$OUT"
