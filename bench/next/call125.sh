#!/usr/bin/env bash
# Device call 125 (session 47): `triton_gemv.TUNED_ONE_ROW` (main: Phi-3-mini's qkv, gate_up and
# LM head, Gemma-3-12B's gate_up and LM head at 8 x 1,024; the plans call 124 measured) through
# its GPU tests and Phi-3's and Gemma's graphs against torch, then issue 31's offline fraction,
# Qwen3-8B against Llama-3-8B, one round each (call 116's; ~6 min).
set -uo pipefail
OUT=${OUT:?}
. bench/next/batch1.sh
TEST_LIMIT=150 gpu_tests tests/gpu/test_families_cuda.py -- \
  "tuned_one_row or ((phi or gemma-3) and graphs_equals_torch)"
for m in llama-3-8b qwen3-8b; do
  timeout 140 bench/device_env.sh python3 -m kvfleet.cli.main bench throughput --model "$m" \
    --load-format dummy --json "$OUT/offline-$m.json" > "$OUT/log-$m.txt" 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], \
{k: d.get(k) for k in ('output_tok_per_s', 'total_tok_per_s', 'pct_of_floor', 'preemptions')})" \
    "$OUT/offline-$m.json"
done
