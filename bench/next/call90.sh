#!/usr/bin/env bash
# Device call 90 (branch gpu-next26): Qwen3's and Gemma 3's q/k norms and RoPE made in decode
# attention at batch 1 from the plain qkv GEMV's raw row, k and v written into the cache by the
# split holding the token (`RawToken`, `triton_attention.TOKEN_IN_ATTENTION`), in place of
# the GEMV's last program of each head counting in (acq_rel) and reloading the head (~2 us a
# layer over Llama's qkv, call 77). sm_90 here: the decode kernel 156 -> 164 registers, no
# stack, 39 KB shared as before, +808 SASS instructions (q's group normalized and rotated).
# Against main (.stage/base; `bash bench/next/stage.sh` on the branch, carry .whl and .stage):
# GPU tests (the new family test, the RoPE-in-qkv test of Qwen3 and Gemma 3, LoRA's engine
# test: a LoRA-wrapped qkv takes the raw path at batch 1), batch 1 main ->
# branch for Qwen3-8B, Qwen3-30B-A3B, Gemma-3-12B and INT4 (RTN) Llama-3-8B, whose RoPE kernel
# after the 4-bit GEMV (2.84 us a layer) the attention takes over too; A3B's trace (~8 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=270 gpu_tests tests/gpu/test_families_cuda.py tests/gpu/test_lora_cuda.py -- \
  "token_made_in_decode or (rope_in_the_qkv and (qwen3 or gemma-3)) or engine_triton_path"
batch1_ab 1 qwen3-8b qwen3-30b-a3b gemma-3-12b
AB_ARGS="--quantization rtn" AB_TAG=-int4 batch1_ab 1 llama-3-8b
batch1_trace qwen3-30b-a3b
python3 bench/next/summary.py "$OUT"
