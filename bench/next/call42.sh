#!/usr/bin/env bash
# Device call 42 (~3 min): a lone prompt's TTFT computed whole (`bench latency
# --no-prefix-caching`; issue 32's batch-1 TTFT row repeats its prompt, so each timed run is a
# prefix hit), 128 and 1,024 tokens, bf16 and FP8 weights + cache: call 41's FP8 online row was
# no faster than bf16's.
set -uo pipefail
OUT=${OUT:?}
for q in bf16 fp8; do
  extra=""; [ $q = fp8 ] && extra="--quantization fp8 --kv-cache-dtype fp8"
  for n in 128 1024; do
    timeout 120 bench/device_env.sh python3 -m kvfleet.cli.main bench latency --model llama-3-8b \
      --load-format dummy --batch-size 1 --input-len $n --output-len 2 --no-prefix-caching \
      $extra --json "$OUT/$q-$n.json" > "$OUT/$q-$n.log" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('$q $n', d['ttft_ms'], d['ttft_prefix_hit'], d['matmul_TFLOPs'])" "$OUT/$q-$n.json"
  done
done
