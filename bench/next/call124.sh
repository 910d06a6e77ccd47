#!/usr/bin/env bash
# Device call 124 (session 47): `triton_gemv.WIDE_BF16_MANY` with its K rule (8 x 1,024 only
# where K < 4,096: call 123 had it win at Gemma-3-12B and Phi-3-mini, lose at Llama-3-8B and
# Qwen3-8B, K = 4,096). Its GPU tests, then batch 1 main against it at the shapes it now reaches
# (Qwen2.5-7B's gate_up and LM head, K 3,584; Qwen3-30B-A3B's LM head, K 2,048; Gemma-3-12B and
# Phi-3-mini again), and Phi-3-mini's trace with it on (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant many engine/layers/triton_gemv.py WIDE_BF16_MANY
flag_on engine/layers/triton_gemv.py WIDE_BF16_MANY  # (this copy: the GPU tests, the trace)
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py -- \
  "many_sixteen_row or (rope_in_the_qkv and phi)"
batch1_variants 2 qwen2.5-7b .stage/base /tmp/var/many
batch1_variants 2 qwen3-30b-a3b .stage/base /tmp/var/many
batch1_variants 1 gemma-3-12b .stage/base /tmp/var/many
batch1_variants 1 phi-3-mini .stage/base /tmp/var/many
batch1_trace phi-3-mini
python3 bench/next/summary.py "$OUT"
