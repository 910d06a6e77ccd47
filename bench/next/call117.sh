#!/usr/bin/env bash
# Device call 117 (main after session 45): the q/k norms' last program of a head with the head's
# norm weight and rotation tables loaded before its count (`triton_rope.QK_TABLES_FIRST`: sm_90
# SASS, Qwen3's qkv plan: the tail after the atomic is the head's load, the norm and the
# stores; before, the weight and table loads waited for the norm's reduction, one more L2 trip).
# The RoPE-in-qkv GPU test with it on, then batch 1 main -> first at Qwen3-8B, Qwen3-30B-A3B
# and Gemma-3-12B (q/k norms all), two rounds (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/triton_rope.py
variant first $F QK_TABLES_FIRST
flag_on $F QK_TABLES_FIRST  # (this copy: the GPU test)
TEST_LIMIT=120 gpu_tests tests/gpu/test_families_cuda.py -- "rope_in_the_qkv_gemv"
batch1_variants 2 qwen3-8b .stage/base /tmp/var/first
batch1_variants 2 qwen3-30b-a3b .stage/base /tmp/var/first
batch1_variants 2 gemma-3-12b .stage/base /tmp/var/first
python3 bench/next/summary.py "$OUT"
