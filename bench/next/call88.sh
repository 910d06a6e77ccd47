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
. bench/next/batch1.sh
gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- "splits_merged or gemv"
batch1_ab 1 llama-3-8b qwen3-8b qwen3-30b-a3b
batch1_trace qwen3-30b-a3b
python3 bench/next/summary.py "$OUT"
