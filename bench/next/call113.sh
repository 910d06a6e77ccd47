#!/usr/bin/env bash
# Device call 113 (main after session 45): `triton_gemv.WIDE_BF16` (bf16 layers of up to 4,096
# outputs not preloading at 8 x 1,024 tiles; landed on Llama-3-8B's and Qwen3-8B's figures,
# call 112) at the other shipped shapes it reaches: Gemma-3-12B (o, down of 3,840 outputs),
# Qwen2.5-7B (o, down of 3,584), Phi-3-mini (o, down of 3,072), Llama-3.2-1B (qkv, down),
# Mixtral-8x7B (o); main (on) against a copy with it off. Then the o GPU tests at main (~8 min).
# A shape that loses: a rule in `one_row_plan` that keeps it off there, with its figures.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant narrow engine/layers/triton_gemv.py '!WIDE_BF16'
batch1_variants 2 gemma-3-12b .stage/base /tmp/var/narrow
batch1_variants 2 qwen2.5-7b .stage/base /tmp/var/narrow
batch1_variants 2 phi-3-mini .stage/base /tmp/var/narrow
batch1_variants 2 llama-3.2-1b .stage/base /tmp/var/narrow
batch1_variants 1 mixtral-8x7b .stage/base /tmp/var/narrow
TEST_LIMIT=120 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "splits_left_to_the_o or splits_merged_by_the_o_gemv"
python3 bench/next/summary.py "$OUT"
