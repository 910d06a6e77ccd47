#!/usr/bin/env bash
# Device call 133 (session 49's build): `triton_moe_gemv.RANKED_BY_ROUTER` (the top k ranked
# once by the router's GEMV; down's split programs read their expert and first tile before
# their wait). Stage main's tree before it first: `bash bench/next/stage.sh a43d82e`. The GPU
# tests, then batch 1: a43d82e / this tree with the flag off (the down kernel's loop restated)
# / on: Qwen3-30B-A3B two rounds, Mixtral-8x7B one (~7 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
M=engine/layers/triton_moe_gemv.py
TEST_LIMIT=${TEST_LIMIT:-200} gpu_tests tests/gpu/test_families_cuda.py -- \
  "top_k_ranked or one_token_gemvs or one_tokens_experts"
grep -aE "^E  " "$OUT/tests.txt" | head -8
variant off $M
variant ranked $M RANKED_BY_ROUTER
batch1_variants 2 qwen3-30b-a3b .stage/base /tmp/var/off /tmp/var/ranked
batch1_variants 1 mixtral-8x7b .stage/base /tmp/var/off /tmp/var/ranked
python3 bench/next/summary.py "$OUT"
