#!/usr/bin/env bash
# Device call 37 (~8 min): the decode kernel's split count a runtime argument (one variant for
# every count above 1; its last split merges only the splits that hold keys, 8 partials a load
# round). A mixed step's decodes split by their number and the step's longest KV took counts no
# decode graph took, each compiled mid-serving. GPU tests (no compile mid-serving, now with a
# 6k prompt's chunks beside 3 and 5 decodes; decode kernel and graphs against torch; FP8
# cache), then batch 1 (128 and 4,000 tokens in), batch 64 and FP8 batch 1 against main.
# (call38.sh runs it with other tests TESTS_K, cases CASES and ROUNDS rounds)
set -uo pipefail
OUT=${OUT:?}
L="--model llama-3-8b --load-format dummy"
timeout 240 bench/device_env.sh python3 -m pytest -o addopts=--import-mode=importlib -q \
  -p no:cacheprovider tests/gpu/test_engine_cuda.py tests/gpu/test_triton_cuda.py \
  tests/gpu/test_fp8_kv_cuda.py -k "${TESTS_K:-no_kernel_compiles or decode or graph or fp8}" \
  2>&1 | grep -E "passed|failed|Error|assert" | tail -8
rounds=${ROUNDS:-1}
ab() {  # $1: name; the rest: bench latency arguments
  local name=$1; shift
  timeout $((150 * rounds)) bash bench/ab.sh .stage/base "$rounds" "$OUT/$name" bench latency \
    $L "$@" > "$OUT/$name.log" 2>&1
  for f in "$OUT/$name"/*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('$name', sys.argv[1].split('/')[-1], {k: v for k, v in d.items() if k in ('decode_ms_per_token', 'pct_of_floor', 'ttft_ms')})" \
      "$f" 2>&1 | tail -1
  done
}
declare -A args=(
  [b1]="--batch-size 1" [b1-4k]="--batch-size 1 --input-len 4000" [b64]="--batch-size 64"
  [fp8-b1]="--batch-size 1 --quantization fp8 --kv-cache-dtype fp8"
)
for name in ${CASES:-b1 b1-4k b64 fp8-b1}; do
  ab "$name" ${args[$name]}
done
