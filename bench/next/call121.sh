#!/usr/bin/env bash
# Device call 121 (session 46): Phi-3-mini's batch 1 (call 120: 3.47 ms, ~51% of its floor).
# `torch_layers.ROTARY_ANY_HEAD`: heads whose halves are no power of two (its 96) through the
# Triton RoPE kernels with masked lanes, rotated in the bf16 qkv GEMV at batch 1 (the trace:
# ~25 us a layer of torch RoPE and cache-write kernels on the path); `linear.SPLITS_ANY_HEAD`:
# decode attention's splits left to o's GEMV for such heads too, merged input by input (the
# attention's own merge took ~4.5 us of 8.65 a layer at A3B, session 41). The GPU tests with
# both on, then batch 1 main / anyhead / both at Phi-3-mini (two rounds) and main / both at
# Llama-3-8B (one: the RoPE kernels' masks), Phi-3-mini's trace with both on, and its bf16
# layers alone at a few tiles (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
variant anyhead engine/layers/torch_layers.py ROTARY_ANY_HEAD
variant both engine/layers/torch_layers.py ROTARY_ANY_HEAD engine/layers/linear.py SPLITS_ANY_HEAD
flag_on engine/layers/torch_layers.py ROTARY_ANY_HEAD  # (this copy: the GPU tests, the trace)
flag_on engine/layers/linear.py SPLITS_ANY_HEAD
TEST_LIMIT=240 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_triton_cuda.py -- \
  "fused_rope_and_silu or splits_left_to_the_o or (phi and (graphs_equals_torch or rope_in_the_qkv or splits_merged_by_the_o))"
batch1_variants 2 phi-3-mini .stage/base /tmp/var/anyhead /tmp/var/both
batch1_variants 1 llama-3-8b .stage/base /tmp/var/both
batch1_trace phi-3-mini
timeout 120 bench/device_env.sh python3 bench/gemv.py --methods triton \
  --shapes phi3-qkv phi3-o phi3-gate_up phi3-down \
  --tiles 8,512,4,3 8,1024,4,3 16,512,4,3 16,256,4,3 2>&1 | tail -5
python3 bench/next/summary.py "$OUT"
