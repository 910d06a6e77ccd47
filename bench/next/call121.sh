#!/usr/bin/env bash
# Device call 121 (session 46): `torch_layers.ROTARY_ANY_HEAD` (heads whose halves are no power
# of two, Phi-3's 96, through the Triton RoPE kernels with masked lanes, and rotated in the bf16
# qkv GEMV at batch 1; call 120's trace: ~25 us a layer of torch RoPE and cache-write kernels on
# Phi-3-mini's batch-1 path, 3.47 ms at ~51% of its floor). The GPU tests with it on (RoPE
# rounding at heads of 96, Phi-3 graphs against torch, the qkv GEMV's RoPE at Phi-3 in bf16
# and FP8 weights), then batch 1 main -> on at Phi-3-mini (two rounds) and Llama-3-8B (one: the
# RoPE kernels' masks), then Phi-3-mini's trace with it on (~5 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
F=engine/layers/torch_layers.py
variant anyhead $F ROTARY_ANY_HEAD
flag_on $F ROTARY_ANY_HEAD  # (this copy: the GPU tests and the trace)
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "fused_rope_and_silu or (phi and (graphs_equals_torch or rope_in_the_qkv))"
batch1_variants 2 phi-3-mini .stage/base /tmp/var/anyhead
batch1_variants 1 llama-3-8b .stage/base /tmp/var/anyhead
batch1_trace phi-3-mini
python3 bench/next/summary.py "$OUT"
