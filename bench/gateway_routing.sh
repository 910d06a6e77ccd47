#!/usr/bin/env bash
# Prefix-aware routing against round-robin: two CPU SmolLM2 engines behind the gateway, groups of
# requests sharing long prefixes; per policy the engines' prefix-cache hit rate and the TTFT.
#   bench/gateway_routing.sh OUT_DIR
set -euo pipefail
OUT=${1:?an output folder}
mkdir -p "$OUT"
KV=".venv/bin/kvfleet"
PY=".venv/bin/python"
ports=(8301 8302)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for port in "${ports[@]}"; do
  $KV engine --model smollm2 --host 127.0.0.1 --port "$port" --dtype float32 \
    --max-model-len 2048 --num-blocks 1024 --log-level warning > "$OUT/engine-$port.log" 2>&1 &
  pids+=($!)
done
for port in "${ports[@]}"; do
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 0.5; done
done
hits() {  # total prefix-cache hits and queries over both engines
  for port in "${ports[@]}"; do curl -s "http://127.0.0.1:$port/metrics"; done | $PY -c '
import sys
h = q = 0.0
for line in sys.stdin:
    if line.startswith("kvfleet:prefix_cache_hits_total"): h += float(line.split()[-1])
    if line.startswith("kvfleet:prefix_cache_queries_total"): q += float(line.split()[-1])
print(int(h), int(q))'
}
seed=1
for policy in prefix round-robin; do
  $KV gateway --replica http://127.0.0.1:8301 --replica http://127.0.0.1:8302 --host 127.0.0.1 \
    --port 8300 --policy "$policy" --log-level "${GATEWAY_LOG_LEVEL:-warning}" > "$OUT/gateway-$policy.log" 2>&1 &
  gw=$!
  until curl -sf http://127.0.0.1:8300/health > /dev/null; do sleep 0.3; done
  sleep 1
  read -r h0 q0 < <(hits)
  # a fresh seed per policy: new documents, so the first policy's cache does not help the second
  $KV bench serve --base-url http://127.0.0.1:8300 --mode shared-prefix --num-prefixes 7 \
    --prefix-len 768 --num-prompts 49 --input-len 16 --output-len 4 --max-concurrency 2 \
    --vocab-size 49152 --seed "$seed" --json "$OUT/serve-$policy.json" > /dev/null
  read -r h1 q1 < <(hits)
  $PY -c "import json; r = json.load(open('$OUT/serve-$policy.json')); print('$policy', 'hit rate', round(($h1-$h0)/max(1,$q1-$q0), 3), 'ttft p50 ms', r['ttft_ms']['p50'], 'p90', r['ttft_ms']['p90'])" | tee -a "$OUT/summary.txt"
  kill $gw; wait $gw 2>/dev/null || true
  seed=$((seed + 1))
done
