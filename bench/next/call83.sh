#!/usr/bin/env bash
# Device call 83 (branch gpu-next22): call 82 took decode attention's batch-1 path apart
# (Qwen3-30B-A3B, a layer: 8.65 us whole; 6.56 without the loads and products after the wait;
# 2.07 without the merge too: the partials, counter and merge take 4.5 us). Here a split's
# keys as one big tile, all loaded before the wait: G256 = tiles of 256 keys on 16 warps, splits
# of at least 256 (at 129-256 keys one split: no merge); G128 = 128 keys on 8 warps, splits of at
# least 128 (two, each one tile). Against this branch (64 on 4 warps, three or four splits).
# Timing at bench latency's default context only (16 warps' tiles take 143 KB of shared memory:
# one program an SM). ~4 min.
set -uo pipefail
OUT=${OUT:?}
A="--load-format dummy --batch-size 1"
for v in G256:256:16:2 G128:128:8:3; do
  IFS=: read -r name n w s <<< "$v"
  mkdir -p /tmp/$name && cp -r engine bench cli gateway operator /tmp/$name/
  f=/tmp/$name/engine/attention/triton_decode.py
  sed -i "s/^_MIN_SPLIT_TOKENS = 64/_MIN_SPLIT_TOKENS = $n/" $f
  sed -i "s/^    False: (64, 4, 3, None),/    False: ($n, $w, $s, None),/" $f
  sed -i "s/^    block_n = kv_tile_tokens(block_n, block_d)/    block_n = block_n if not fp8 else kv_tile_tokens(block_n, block_d)/" $f
  grep -nE "^_MIN_SPLIT_TOKENS|^    False: \(|^    block_n = block_n" $f
done
for run in G256:llama-3-8b G256:qwen3-30b-a3b G256:qwen3-8b G128:llama-3-8b G128:qwen3-30b-a3b; do
  v=${run%%:*} m=${run#*:}
  (cd /tmp/$v && ln -sfn "$OLDPWD/.whl" .whl && timeout 130 bash "$OLDPWD/bench/ab.sh" \
     "$OLDPWD" 1 "$OUT/$v-$m" bench latency --model $m $A) > "$OUT/$v-$m.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
