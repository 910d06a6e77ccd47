#!/usr/bin/env bash
# Device call 76 (branch gpu-next20): call 75's A/B (WIDE_QKV on against off) at the other
# shapes it changes: Qwen3-8B's qkv (6144 x 4096) and Gemma-3-12B's (8192 x 3840).
set -uo pipefail
OUT=${OUT:?}
mkdir -p /tmp/narrow && cp -r engine bench cli gateway operator /tmp/narrow/
sed -i 's/^WIDE_QKV = True/WIDE_QKV = False/' /tmp/narrow/engine/layers/triton_gemv.py
A="--load-format dummy --batch-size 1"
for m in qwen3-8b gemma-3-12b; do
  timeout 140 bash bench/ab.sh /tmp/narrow 1 "$OUT/$m" bench latency --model $m $A \
    > "$OUT/ab-$m.txt" 2>&1
done
python3 bench/next/summary.py "$OUT"
