#!/usr/bin/env bash
# Device call 115 (main after session 45): one token's MoE gate_up and split down GEMVs loading
# their next tiles while one is used (`triton_moe_gemv.MOE_AHEAD`: more bytes in flight a
# program, as session 45's bf16 o and down); the MoE GPU tests with it on, then batch 1 main
# -> ahead at Qwen3-30B-A3B (gate_up 16.8 us a layer on the path, floor 12; split down 11.2,
# floor 6), two rounds, and Mixtral-8x7B (its gate_up only: down over all k), one (~5 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/triton_moe_gemv.py
variant ahead $F MOE_AHEAD
flag_on $F MOE_AHEAD  # (this copy: the GPU tests)
TEST_LIMIT=150 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "experts_match_reference_at_real_shapes or one_tokens_experts"
batch1_variants 2 qwen3-30b-a3b .stage/base /tmp/var/ahead
batch1_variants 1 mixtral-8x7b .stage/base /tmp/var/ahead
python3 bench/next/summary.py "$OUT"
