#!/usr/bin/env bash
# Device call 90 (branch gpu-next26): Qwen3's and Gemma 3's q/k norms and RoPE made in decode
# attention at batch 1 from the plain qkv GEMV's raw row, k and v written into the cache by the
# split holding the token (`RawToken`, `triton_attention.QK_NORM_IN_ATTENTION`), in place of
# the GEMV's last program of each head counting in (acq_rel) and reloading the head (~2 us a
# layer over Llama's qkv, call 77). sm_90 here: the decode kernel 156 -> 164 registers, no
# stack, 39 KB shared as before, +808 SASS instructions (q's group normalized and rotated).
# Against main (.stage/base; `bash bench/next/stage.sh` on the branch, carry .whl and .stage):
# GPU tests (the new family test, the RoPE-in-qkv test of Qwen3 and Gemma 3), batch 1 main ->
# branch for Qwen3-8B, Qwen3-30B-A3B, Gemma-3-12B, A3B's trace (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
gpu_tests tests/gpu/test_families_cuda.py -- \
  "qk_norms_made or (rope_in_the_qkv and (qwen3 or gemma-3))"
batch1_ab 1 qwen3-8b qwen3-30b-a3b gemma-3-12b
batch1_trace qwen3-30b-a3b
python3 bench/next/summary.py "$OUT"
