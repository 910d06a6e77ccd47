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
A="--load-format dummy --batch-size 1"
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  tests/gpu/test_families_cuda.py -k "qk_norms_made or (rope_in_the_qkv and (qwen3 or gemma-3))" \
  > "$OUT/tests.txt" 2>&1
grep -aE "^FAILED|passed|failed|error" "$OUT/tests.txt" | tail -8
for m in qwen3-8b qwen3-30b-a3b gemma-3-12b; do
  timeout 130 bash bench/ab.sh .stage/base 1 "$OUT/$m" bench latency --model $m $A \
    > "$OUT/ab-$m.txt" 2>&1
done
timeout 150 bench/device_env.sh python3 bench/profile_decode.py --model qwen3-30b-a3b \
  --batch-size 1 --trace "$OUT/trace-a3b.json" > "$OUT/profile-a3b.txt" 2>&1
gzip -f "$OUT/trace-a3b.json"
python3 bench/next/summary.py "$OUT"
