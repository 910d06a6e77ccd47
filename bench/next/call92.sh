#!/usr/bin/env bash
# Device call 92 (branch gpu-next28): call 90's raw token in decode attention kept only where
# the qkv layer cannot rotate and q and k have no norms (4/8-bit weights, LoRA): the RoPE kernel
# after the 4-bit GEMV (2.84 us a layer) off the path. Call 90 (norms in the attention too):
# INT4 Llama-3-8B 2.586 -> 2.537 ms, Qwen3-8B 4.331 -> 4.374, A3B 2.580 -> 2.615, Gemma-3-12B
# 7.014 -> 7.145. Against main (.stage/base; `bash bench/next/stage.sh` on the branch, carry
# .whl and .stage): GPU tests (the family test under INT4 weights, the RoPE-in-qkv tests of
# Qwen3 and Gemma 3 as on main, LoRA's engine test), batch 1 main -> branch for INT4 (RTN)
# Llama-3-8B two rounds, bf16 Llama-3-8B and Qwen3-8B (unchanged paths) (~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=270 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_lora_cuda.py -- \
  "token_made_in_decode or (rope_in_the_qkv and (qwen3 or gemma-3)) or engine_triton_path"
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 2 llama-3-8b
batch1_ab 1 llama-3-8b qwen3-8b
python3 bench/next/summary.py "$OUT"
