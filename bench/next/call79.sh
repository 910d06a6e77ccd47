#!/usr/bin/env bash
# Device call 79 (branch gpu-next22): decode attention at batch 1 and bench latency's context
# (128 in, 128 out: 129-256 keys, two live splits of 128 at _MIN_SPLIT_TOKENS 128, so a merge
# every layer). Trees: A = main (.stage/base), B = main with each split at least 256 keys (one
# live split up to 256: the output written directly, no partials, no atomic, no merge), C = this
# branch (this step's K and V loaded with q, in flight together) with 256-key splits.
# `bash bench/next/stage.sh` here first; carry .whl and .stage. ~5 min.
#   call79.sh        A -> B and B -> C, batch 1, Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
mkdir -p /tmp/B /tmp/C
cp -r .stage/base/. /tmp/B/ && cp -r engine bench cli gateway operator /tmp/C/
for t in /tmp/B /tmp/C; do
  sed -i 's/^_MIN_SPLIT_TOKENS = 128/_MIN_SPLIT_TOKENS = 256/' $t/engine/attention/triton_decode.py
  grep -c "^_MIN_SPLIT_TOKENS = 256" $t/engine/attention/triton_decode.py
done
# (ab.sh runs the working tree as "after": C's tree put in place, B as "before")
for m in llama-3-8b qwen3-8b qwen3-30b-a3b; do
  (cd /tmp/B && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
     "$OLDPWD/.stage/base" 1 "$OUT/AB-$m" bench latency --model $m $A) > "$OUT/AB-$m.txt" 2>&1
  (cd /tmp/C && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
     /tmp/B 1 "$OUT/BC-$m" bench latency --model $m $A) > "$OUT/BC-$m.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
