#!/usr/bin/env bash
# Device call 123 (session 47): two flags built off. `llama.SANDWICH_ROWS_IN_GEMV` (Gemma's input
# and pre-feed-forward norms made by the qkv and gate_up GEMVs after them; call 120's
# Gemma-3-12B trace: four norm kernels a layer at 1.4 us) and `triton_gemv.WIDE_BF16_MANY` (bf16
# layers of 16-row programs too many for four an SM at 8 x 1,024 on 4 warps: gate_up layers,
# Phi-3's qkv, LM heads; call 121 alone: Phi-3's gate_up 28.7 -> 23.6 us, qkv 18.2 -> 15.3).
# The GPU tests with both on, the layers alone at both plans, then batch 1 main against each
# (~8 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant sandwich engine/models/llama.py SANDWICH_ROWS_IN_GEMV
variant many engine/layers/triton_gemv.py WIDE_BF16_MANY
flag_on engine/models/llama.py SANDWICH_ROWS_IN_GEMV  # (this copy: the GPU tests)
flag_on engine/layers/triton_gemv.py WIDE_BF16_MANY
TEST_LIMIT=240 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "sandwich_norms or many_sixteen_row or graphs_equals_torch or (rope_in_the_qkv and (phi or qwen3))"
timeout 150 bench/device_env.sh python3 bench/gemv.py --methods triton \
  --shapes 8b-tp1-gate_up qwen3-8b-gate_up qwen2.5-gate_up gemma3-gate_up phi3-qkv \
  phi3-gate_up 8b-lm-head phi3-lm-head gemma3-lm-head \
  --tiles 16,256,4,3 8,1024,4,3 2>&1 | tail -10
batch1_variants 2 gemma-3-12b .stage/base /tmp/var/sandwich /tmp/var/many
batch1_variants 2 phi-3-mini .stage/base /tmp/var/many
batch1_variants 2 llama-3-8b .stage/base /tmp/var/many
batch1_variants 1 qwen3-8b .stage/base /tmp/var/many
python3 bench/next/summary.py "$OUT"
