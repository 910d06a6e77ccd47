#!/usr/bin/env bash
# Device call 114 (main after session 45): the qkv-like layers at 8 x 1,024
# (`triton_gemv.NARROW_QKV`) and 4 x 1,024 (with `NARROW_QKV_FOUR`) tiles, where WIDE_QKV takes
# 16 x 512: Llama-3-8B's qkv alone 15.1 -> 13.9 / 13.2 us (floor 11.9; call 111). The RoPE-in-
# qkv GPU test with the 4-row form, then batch 1 main / narrow8 / narrow4 at Llama-3-8B,
# Qwen3-8B (q/k norms: more programs a head) and Qwen3-30B-A3B, two rounds (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/triton_gemv.py
variant narrow8 $F NARROW_QKV
variant narrow4 $F NARROW_QKV $F NARROW_QKV_FOUR
flag_on $F NARROW_QKV && flag_on $F NARROW_QKV_FOUR  # (this copy: the GPU test, 4 rows)
TEST_LIMIT=120 gpu_tests tests/gpu/test_families_cuda.py -- "rope_in_the_qkv_gemv"
batch1_variants 2 llama-3-8b .stage/base /tmp/var/narrow8 /tmp/var/narrow4
batch1_variants 2 qwen3-8b .stage/base /tmp/var/narrow8 /tmp/var/narrow4
batch1_variants 2 qwen3-30b-a3b .stage/base /tmp/var/narrow8 /tmp/var/narrow4
python3 bench/next/summary.py "$OUT"
