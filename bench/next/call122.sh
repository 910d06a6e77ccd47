#!/usr/bin/env bash
# Device call 122 (session 46): `llama.SANDWICH_ROWS_IN_GEMV` (Gemma's input and
# pre-feed-forward norms, each a residual add + RMSNorm, made by the qkv and gate_up GEMVs
# after them, as Llama's layers do; call 120's Gemma-3-12B trace: four norm kernels a layer,
# 1.4 us each on the path). Its GPU tests and Gemma's graphs against torch with it on, then
# batch 1 main -> on at Gemma-3-12B, two rounds (~4 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/models/llama.py
variant sandwich $F SANDWICH_ROWS_IN_GEMV
flag_on $F SANDWICH_ROWS_IN_GEMV  # (this copy: the GPU tests)
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py -- \
  "sandwich_norms or (gemma and graphs_equals_torch)"
batch1_variants 2 gemma-3-12b .stage/base /tmp/var/sandwich
python3 bench/next/summary.py "$OUT"
