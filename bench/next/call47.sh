#!/usr/bin/env bash
# Device call 47: where Llama-3-8B batch-1 decode time goes now with FP8 weights (and INT4),
# kernel by kernel (launched normally, so that each kernel's time is its own), after sessions
# 28-31's fusions (norms and RoPE + cache write in the GEMVs, attention merged in its last split).
set -uo pipefail
OUT=${OUT:?}
for q in fp8 rtn; do
  echo "== $q, dependent launch off"
  KVFLEET_DEPENDENT_LAUNCH=0 timeout 200 bench/device_env.sh python3 bench/profile_decode.py \
    --batch-size 1 --quantization $q --profile > "$OUT/profile-$q.txt" 2>&1
  grep -v "^\s*$" "$OUT/profile-$q.txt" | grep -iE "step|replay|GPU|kernel|gemv|attention|norm|rope|silu|mma|Self CUDA" | head -40
done
