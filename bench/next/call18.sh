#!/usr/bin/env bash
# Device call 18 (gpu-next10, ~3 min): where a Qwen3-30B-A3B and a Llama-3-8B batch-1 step go
# now (the MoE GEMVs, the RoPE in the qkv GEMV): profiles with dependent launches off, so that
# each kernel's time is its own (with them on, each kernel's wait for the one before is
# counted in it).
set -uo pipefail
OUT=${OUT:?}
for model in qwen3-30b-a3b llama-3-8b; do
  KVFLEET_DEPENDENT_LAUNCH=0 timeout 150 bench/device_env.sh python3 bench/profile_decode.py \
    --model $model --batch-size 1 --profile > "$OUT/profile-$model.txt" 2>&1
  grep -v "^WARNING" "$OUT/profile-$model.txt" | tail -40 | cut -c1-160
done
