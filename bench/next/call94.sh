#!/usr/bin/env bash
# Device call 94 (branch gpu-next28 as it lands): the raw token's GPU tests with the rotation's
# tables loaded before the wait (call 93 measured it: INT4 Llama-3-8B 2.535 -> 2.518 ms): the
# family test under INT4 weights (Llama, Gemma 2, Qwen3 keeping the RoPE kernel), the
# RoPE-in-qkv tests of Llama, Qwen3 and Gemma 3, LoRA's engine test (~3 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=270 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_lora_cuda.py -- \
  "token_made_in_decode or (rope_in_the_qkv and auto-) or engine_triton_path"
python3 bench/next/summary.py "$OUT"
