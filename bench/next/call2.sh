#!/usr/bin/env bash
# Device call 2 (about 9 minutes): 1k/1k FP8 + FP8 KV against main; batch-1 bf16 with each
# change switched off (NORM_IN_GEMV, GATED_GEMV, FUSED_MERGE), for their shares.
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 300 bash bench/ab.sh .stage/base 1 "$OUT/1k1k-fp8" bench throughput $L --num-prompts 1000 \
  --input-len 1024 --output-len 1024 --quantization fp8 --kv-cache-dtype fp8 2>&1 | grep -v "^WARNING" | tail -6
for v in no-norm no-gated no-merge; do
  timeout 60 bash bench/ab.sh ".stage/$v" 1 "$OUT/b1-bf16-$v" bench latency $L --batch-size 1 2>&1 | grep -v "^WARNING" | tail -3
done
