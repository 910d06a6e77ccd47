#!/usr/bin/env bash
# Device call 80 (branch gpu-next22): call 79 found one 256-key split slower than two 128-key
# splits and their merge (Llama-3-8B 4.192 -> 4.230 ms, Qwen3-8B 4.417 -> 4.454): the tiles
# after the wait cost more than the merge. Here the other way: each split at least 64 keys
# (BLOCK_N: at 129-256 keys 3-4 live splits of one tile each, all loaded before the wait)
# against the branch as it is (128). `bash bench/next/stage.sh` here first; carry .whl and
# .stage. ~3 min.
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
mkdir -p /tmp/D && cp -r engine bench cli gateway operator /tmp/D/
sed -i 's/^_MIN_SPLIT_TOKENS = 128/_MIN_SPLIT_TOKENS = 64/' /tmp/D/engine/attention/triton_decode.py
grep -c "^_MIN_SPLIT_TOKENS = 64" /tmp/D/engine/attention/triton_decode.py
for m in llama-3-8b qwen3-8b qwen3-30b-a3b; do
  (cd /tmp/D && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
     "$OLDPWD" 1 "$OUT/CD-$m" bench latency --model $m $A) > "$OUT/CD-$m.txt" 2>&1
done
(cd /tmp/D && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
   "$OLDPWD" 1 "$OUT/CD-llama-8k" bench latency --model llama-3-8b $A --max-model-len 8192) \
   > "$OUT/CD-llama-8k.txt" 2>&1
python3 bench/next/summary.py "$OUT"
