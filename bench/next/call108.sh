#!/usr/bin/env bash
# Device call 108 (main after gpu-next33 lands): act(gate) x up made by the gate_up
# projection's bf16 GEMV (`linear.GATED_IN_GEMV`, off as built: turned on here in the device's
# copy only), in place of `act_and_mul`'s kernel after it (~1.3 us a layer on bf16's batch-1
# path, session 37). The GPU test (the same bits either way: Llama, Gemma 2's GeGLU, Qwen3),
# then batch 1 off (.stage/base) -> on: Llama-3-8B and Qwen3-8B two rounds, Gemma-3-12B one
# (~7 min). If it wins: the flag on, RESULTS, README.
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
flag_on engine/layers/linear.py GATED_IN_GEMV
TEST_LIMIT=200 gpu_tests tests/gpu/test_families_cuda.py -- "made_by_the_gate_up_gemv"
batch1_ab 2 llama-3-8b qwen3-8b
batch1_ab 1 gemma-3-12b
python3 bench/next/summary.py "$OUT"
